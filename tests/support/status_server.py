"""Kubeflow Trainer's status endpoint as its controller serves it to a
TrainJob's pods (v2.2+, feature gate TrainJobStatus): HTTPS with a CA of its
own, a bearer token in a file, the three variables that say where. It
answers as the controller does, or as a hostile server would."""

import http.server
import socket
import ssl
import subprocess
import threading
import time

import yaml

from support.k8s_pods import K8S


class StatusServer:
    """Records every request, (arrival, headers, body), and answers each with
    `answer(handler, number)` (number: 0 for the first request), by default
    as the controller does: 200 and the applied status."""

    TOKEN = "a-projected-service-account-token"
    NAME = "status.example"  # in its certificate too, for a test to resolve to it

    def __init__(self, address: str, directory, answer=None, token: str = TOKEN):
        self.requests = []
        self._certificate(address, directory)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.body = self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append((time.monotonic(), dict(self.headers), self.body))
                (answer or echo)(self, len(server.requests) - 1)

            def log_message(self, *args):
                pass
        self._http = http.server.ThreadingHTTPServer((address, 0), Handler)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(directory / "server.crt", directory / "server.key")
        self._http.socket = tls.wrap_socket(self._http.socket, server_side=True)
        (directory / "token").write_text(token)
        self.port = self._http.server_address[1]
        self.url = f"https://{address}:{self.port}/apis/status"
        self.env = {"KUBEFLOW_TRAINER_SERVER_URL": self.url,
                    "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(directory / "ca.crt"),
                    "KUBEFLOW_TRAINER_SERVER_TOKEN": str(directory / "token")}

    @staticmethod
    def _certificate(address, directory):
        """A CA, and a certificate it signed for `address`, made by openssl."""
        def openssl(*args):
            subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
        # Elliptic-curve keys: made at once, where an RSA key took seconds
        # on a loaded machine.
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
                "-subj", "/CN=test trainer CA")
        openssl("req", *key, "-keyout", "server.key", "-out", "server.csr",
                "-subj", "/CN=kubeflow-trainer-controller")
        (directory / "san.ext").write_text(
            f"subjectAltName=IP:{address},DNS:{StatusServer.NAME}\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext")

    def __enter__(self):
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._http.shutdown()
        self._http.server_close()


def echo(handler, number):
    """The controller's answer: 200 and the status it applied (here, the
    request's body)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(handler.body)))
    handler.end_headers()
    handler.wfile.write(handler.body)


class Listener:
    """A plain TCP port that records whether anyone connected, and what
    they sent; it answers each connection with `reply` (bytes), if given."""

    def __init__(self, reply: bytes = b""):
        self.received = []
        self._reply = reply
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            with connection:
                connection.settimeout(2)
                if self._reply:
                    connection.sendall(self._reply)
                try:
                    self.received.append(connection.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self):
        self._socket.close()


def trainer_status_schema() -> dict:
    """TrainJob's status.trainerStatus, from the CRD the tests carry."""
    crd = yaml.safe_load((K8S / "schemas" / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "trainerStatus"]
