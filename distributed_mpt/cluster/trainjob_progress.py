"""Progress in the TrainJob's own status, for Kubeflow Trainer v2.2+ with its `TrainJobStatus`
feature gate: `kubectl get trainjob NAME -o jsonpath='{.status.trainerStatus}'` then shows the
progress percentage, the time left and the latest loss and accuracy.

The controller injects KUBEFLOW_TRAINER_SERVER_URL (an HTTPS endpoint),
KUBEFLOW_TRAINER_SERVER_CA_CERT (its CA certificate) and KUBEFLOW_TRAINER_SERVER_TOKEN (a bearer
token), two files that are rotated (the token read at every request, the CA when its file
changed), into the pods (kubeflow/trainer, docs/user-guides/trainjob-progress.md). The chief
POSTs `{"trainerStatus": {"progressPercentage", "estimatedRemainingSeconds", "metrics":
[{"name", "value"}], "lastUpdatedTime"}}` at most every MIN_SECONDS, from a thread of its own so
that a slow server never slows training. A report that fails is one warning, never a failed run.

The server and the three variables are untrusted (DESIGN.md, decision 8). A server that answers
without end, trickles its answer, redirects or breaks TLS costs a warning and at most
REQUEST_SECONDS of this thread: never the run's memory, and never more than CLOSE_SECONDS of its
end (a stopped or failed run's: EARLY_CLOSE_SECONDS). The token goes only over verified HTTPS to
the URL's host: `https` alone, with the injected CA alone, and no redirect followed (urllib
carries the Authorization header across them, to any host and scheme). No message holds the
token or a part of it (nor the token variable, which may hold the token, not its file's path),
nor the URL's user name, password, query or fragment: a warning says what went wrong in this
module's words, the C library's or OpenSSL's, never in the server's (its status line, headers
and body may echo the header back) nor in http.client's, which quote them. Whatever fails in
setting it up, or ends its thread, is a warning too: reporting never stops a run.
"""

import contextlib
import http.client
import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Mapping, Optional, Tuple

from distributed_mpt import files
from distributed_mpt.errors import first_line, quoted

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
# The controller asks for no more than one update every 5 seconds.
MIN_SECONDS = 5.0
# One report as a whole: connection, TLS handshake, request and answer. A
# timeout on each socket operation alone lets a server that sends a byte
# every few seconds hold the thread, and the final report, for ever.
REQUEST_SECONDS = 5.0
# The most close() adds to the end of a run, whatever the server does: the
# final report's turn (MIN_SECONDS after the last one began, which had
# REQUEST_SECONDS <= MIN_SECONDS), the report, a second to close the
# connection.
CLOSE_SECONDS = MIN_SECONDS + REQUEST_SECONDS + 1
# The most close() adds to the end of a run stopped by a signal or failed:
# the pod's grace period (20 s by the launcher's default) is for its checkpoint.
EARLY_CLOSE_SECONDS = 2.0
# The controller refuses requests over 64 KiB and answers with the status it
# applied or a Kubernetes Status (kubeflow/trainer v2.3,
# pkg/statusserver/server.go): a longer answer is not its, and is not read.
# (http.client bounds the headers: 100 lines of 64 KiB.)
MAX_ANSWER_BYTES = 1 << 16
# A projected service-account token is a JWT of about 1 KB, a CA bundle a
# few KB: far larger files are not what the controller mounts.
MAX_TOKEN_BYTES = 1 << 16
MAX_CA_BYTES = 1 << 20
# RFC 6750's b64token, what a bearer token is made of: nothing else goes
# into a header (a newline would forge one) or into a message.
_BEARER_TOKEN = re.compile(rb"[A-Za-z0-9._~+/-]+=*")


class _Refused(Exception):
    """Why the reporter, or one report, cannot go on, in words of this
    module that may be printed as they are."""


class TrainJobStatus:
    """Sends the newest progress to the TrainJob; `close()` sends the last."""

    def __init__(self, url: str, ca_cert: str, token_file: str):
        """Raises _Refused, saying why, if `url` is not https or `ca_cert`
        holds no CA certificate."""
        self._url, self._ca_cert, self._token_file = url, ca_cert, token_file
        self._host, self._port, self._path = _https_endpoint(url)
        self._ca_identity: Optional[tuple] = None
        self._tls()  # a file that holds no CA now: no reports at all
        self._latest: Optional[dict] = None
        self._changed = threading.Condition()
        self._close_by: Optional[float] = None  # time.monotonic(), once close() is called
        self._warned = False
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name="trainjob-status")
        self._thread.start()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ
                         ) -> Optional["TrainJobStatus"]:
        """A sender if Kubeflow Trainer injected its endpoint, else None
        (after one warning if the endpoint is unusable)."""
        names = (URL_ENV, CA_CERT_ENV, TOKEN_ENV)
        values = [environ.get(name) for name in names]
        unset = [name for name, value in zip(names, values) if not value]
        if len(unset) in (1, 2):  # set by hand, one forgotten: it went unreported unsaid
            _warn(f"TrainJob progress is not reported: {' and '.join(unset)} "
                  f"{'is' if len(unset) == 1 else 'are'} not set or empty")
        if unset:
            return None
        try:
            return cls(*values)
        except Exception as e:  # noqa: BLE001 - reporting must never stop a run
            _warn(f"TrainJob progress is not reported: {_why(e, 0.0)}")
            return None

    def update(self, progress_percent: float, eta_seconds: Optional[float],
               metrics: Mapping[str, float]) -> None:
        """Makes this the progress to send next (older unsent ones are dropped)."""
        status = {"progressPercentage": int(max(0, min(100, progress_percent))),
                  "metrics": [{"name": name, "value": f"{value:.6g}"}
                              for name, value in metrics.items()],
                  "lastUpdatedTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if eta_seconds is not None:  # the CRD's field is an int32: the controller refuses more
            status["estimatedRemainingSeconds"] = int(min(round(eta_seconds), 2**31 - 1))
        with self._changed:
            self._latest = {"trainerStatus": status}
            self._changed.notify()

    def close(self, early: bool = False) -> None:
        """Sends what is pending (the final progress, at most MIN_SECONDS later) and stops the
        thread; returns within CLOSE_SECONDS, whatever the server does. `early` (a run stopped or
        failed): within EARLY_CLOSE_SECONDS, what is pending sent only if its turn has come, and
        a report the server holds left to end by itself, unsaid."""
        seconds = EARLY_CLOSE_SECONDS if early else CLOSE_SECONDS
        with self._changed:
            # The thread's own deadline, a second before the join's: it ends
            # by itself, its connection closed, rather than being left behind.
            self._close_by = time.monotonic() + seconds - 1
            self._warned |= early  # the run is ending: its output says why, not the reports'
            self._changed.notify()
        self._thread.join(seconds)
        if self._thread.is_alive():  # held where no deadline reaches: resolving the host's name
            self._failed(f"the final progress was not sent within {seconds:g} s")

    def _send_loop(self) -> None:
        try:
            self._send_reports()
        except BaseException as e:  # noqa: BLE001 - a bug, or no memory to say why: the default
            # hook's traceback held http.client's error, which quotes the server (and the token)
            if not self._warned:
                _warn(f"TrainJob progress is no longer reported: its thread failed "
                      f"({type(e).__name__}); training goes on")

    def _send_reports(self) -> None:
        last_sent = -MIN_SECONDS
        while True:
            with self._changed:
                while self._latest is None and self._close_by is None:
                    self._changed.wait()
                if self._latest is None:
                    return
                # At most one request every MIN_SECONDS, the last one too.
                turn = last_sent + MIN_SECONDS
                if self._close_by is not None and turn > self._close_by - 0.5:
                    return  # too late for an early close (a normal one's comes in time)
                if turn > time.monotonic():
                    self._changed.wait(turn - time.monotonic())
                    continue
                payload, self._latest = self._latest, None
                deadline = time.monotonic() + REQUEST_SECONDS
                if self._close_by is not None:
                    deadline = min(deadline, self._close_by)
            if deadline - time.monotonic() < 0.5:  # close()'s deadline is near: a starved thread
                self._failed("the final progress had no time left")
                return
            # The turn counts from a report's start: counted from its end, a
            # report that took most of REQUEST_SECONDS pushed the next one
            # past the close's deadline, and the final 100% was never sent.
            last_sent = time.monotonic()
            self._post(payload, deadline)

    def _post(self, payload: dict, deadline: float) -> None:
        """One report, over by `deadline` (time.monotonic())."""
        seconds = deadline - time.monotonic()
        try:
            # Both rotated, the CA with the controller's certificate.
            token, tls = _bearer_token(self._token_file), self._tls()
            connection = _Connection(self._host, self._port, tls, deadline)
            try:
                connection.request("POST", self._path, body=json.dumps(payload).encode(),
                                   headers={"Authorization": f"Bearer {token}",
                                            "Content-Type": "application/json"})
                answer = connection.getresponse()
                if 300 <= answer.status < 400:
                    raise _Refused(f"it answered {answer.status}, a redirect, which the token "
                                   f"never follows")
                if not 200 <= answer.status < 300:
                    raise _Refused(f"it answered {answer.status}")
                if len(answer.read(MAX_ANSWER_BYTES + 1)) > MAX_ANSWER_BYTES:
                    raise _Refused(f"it answered with more than {MAX_ANSWER_BYTES:,} bytes")
            finally:
                connection.close()
        except Exception as e:  # noqa: BLE001 - reporting must never stop a run
            self._failed(_why(e, seconds))

    def _tls(self) -> ssl.SSLContext:
        """A TLS context trusting the CA file as it is now, made again only
        when the file changed (Kubernetes rotates it by swapping a link: a
        new file): OpenSSL, holding the GIL, took 130 ms for 860 KB (Zen 5 EPYC)."""
        try:  # before reading it: a file changed in between is read again next time
            found = os.stat(self._ca_cert)
            identity = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
        except OSError:
            identity = None  # reading it says why
        if identity is None or identity != self._ca_identity:
            self._ca_tls, self._ca_identity = _tls_trusting(self._ca_cert), identity
        return self._ca_tls

    def _failed(self, why: str) -> None:
        """A warning for the first report that failed: a server that is down stays down."""
        with self._changed:  # close() warns too, of a thread it gave up on
            warned, self._warned = self._warned, True
        if not warned:
            _warn(f"TrainJob progress not reported to {_shown(self._url)} "
                  f"({quoted(why, 400)}); training goes on")


class _DeadlineSocket(ssl.SSLSocket):
    """A TLS socket whose operations all end by one `deadline`
    (time.monotonic()): each waits at most for the time left."""

    deadline = float("inf")

    def do_handshake(self, block=False):
        self.settimeout(_seconds_left(self.deadline))
        return super().do_handshake(block)

    def recv_into(self, buffer, nbytes=None, flags=0):
        self.settimeout(_seconds_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def send(self, data, flags=0):  # sendall() sends through it
        self.settimeout(_seconds_left(self.deadline))
        return super().send(data, flags)


class _Connection(http.client.HTTPSConnection):
    """The connection of one request, over by `deadline` (name resolution
    aside, which the resolver's own timeouts bound). http.client follows no
    redirect, and reads no more of an answer than it is asked for."""

    # Whatever http.client.HTTPConnection.debuglevel a module of the process
    # set: above 0, each request's headers are printed, the token with them.
    debuglevel = 0

    def __init__(self, host: str, port: int, tls: ssl.SSLContext, deadline: float):
        super().__init__(host, port, context=tls)
        self._deadline = deadline

    def connect(self):
        plain = _connected(self.host, self.port, self._deadline)
        try:
            self.sock = self._context.wrap_socket(plain, server_hostname=self.host,
                                                  do_handshake_on_connect=False)
        except BaseException:
            plain.close()
            raise
        self.sock.deadline = self._deadline
        self.sock.do_handshake()


def _connected(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to the first of `host`'s addresses that takes it, all tried by
    `deadline`: socket.create_connection gives each address the whole timeout, and a name of 4
    addresses that never answer held a report for 20 s, and the run's end past its bound."""
    error = OSError(0, "the host name has no address")
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for tried, (family, kind, protocol, _, address) in enumerate(addresses):
        try:  # an address of a kind this kernel lacks (IPv6 turned off): the next
            plain = socket.socket(family, kind, protocol)
        except OSError as e:
            error = e
            continue
        try:
            # A share of what is left: a dead first address (IPv6 on a
            # network of IPv4) must leave the next one time to answer.
            plain.settimeout(_seconds_left(deadline) / (len(addresses) - tried))
            plain.connect(address)
            return plain
        except OSError as e:
            plain.close()
            error = e
    raise error


def _seconds_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the report's time is up")
    return left


def _https_endpoint(url: str) -> Tuple[str, int, str]:
    """The host, port and path of `url`, which must be https://host[:port]/path."""
    where = f"{URL_ENV}={_shown(url)}"
    if not (url.isascii() and url.isprintable()) or " " in url:
        raise _Refused(f"{where} holds a space, a control character or one that is not ASCII "
                       f"(an international host name goes in its xn-- form)")
    try:
        parts = urllib.parse.urlsplit(url)
        port = 443 if parts.port is None else parts.port
    except ValueError:
        raise _Refused(f"{where} is not a URL") from None
    if parts.scheme != "https" or not parts.hostname:
        raise _Refused(f"{where} is not an https:// URL: the token goes over verified TLS only")
    if parts.username is not None:
        raise _Refused(f"{where} holds a user name: the token is the only credential sent")
    return parts.hostname, port, urllib.parse.urlunsplit(("", "", parts.path or "/",
                                                           parts.query, ""))


def _shown(url: str) -> str:
    """`url` for a message, without its user name and password or its query
    and fragment: each may hold a credential (https://user:pw@..., ?token=...)."""
    scheme, separator, rest = url.partition("://") if "://" in url else ("", "", url)
    if "@" in rest:  # up to the last: a password may hold / ? # unencoded
        rest = "...@" + rest.rpartition("@")[2]
    address, query = re.match(r"([^?#]*)(.*)", rest, re.DOTALL).groups()
    return quoted(f"{scheme}{separator}{address}{'?...' if query else ''}")


def _tls_trusting(ca_cert: str) -> ssl.SSLContext:
    """A TLS context that trusts the CA certificates of `ca_cert` alone and checks the server's
    name. The file is read here, bounded: OpenSSL is given its text, never its path."""
    where = f"{CA_CERT_ENV}={quoted(ca_cert)}"
    data = _read_bounded(ca_cert, MAX_CA_BYTES, where)
    # Not ssl.create_default_context(cadata=...): given an empty file, it
    # would trust the system's CAs instead.
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
    try:
        tls.load_verify_locations(cadata=data.decode("ascii"))
    except UnicodeDecodeError:
        raise _Refused(f"{where} is not a PEM certificate (not ASCII text)") from None
    except (ssl.SSLError, ValueError) as e:
        raise _Refused(f"{where} is not a PEM certificate ({quoted(first_line(e))})") from None
    if not tls.cert_store_stats()["x509_ca"]:
        raise _Refused(f"{where} holds no CA certificate")
    tls.sslsocket_class = _DeadlineSocket
    return tls


def _bearer_token(path: str) -> str:
    """The token in the file at `path` (one trailing newline allowed)."""
    # Not the variable's value: set to the token itself, it was printed whole.
    where = f"the file {TOKEN_ENV} names"
    data = _read_bounded(path, MAX_TOKEN_BYTES, where)
    token = data[:-1] if data.endswith(b"\n") else data
    if not token:
        raise _Refused(f"{where} is empty")
    if not _BEARER_TOKEN.fullmatch(token):  # the message says nothing of what it holds
        raise _Refused(f"{where} does not hold a bearer token (RFC 6750 allows letters, "
                       f"digits, -._~+/ and a trailing =)")
    return token.decode("ascii")


def _read_bounded(path: str, limit: int, where: str) -> bytes:
    """files.read_bounded, its refusals in this module's words."""
    try:
        return files.read_bounded(path, limit)
    except files.NotRegularFileError as e:
        raise _Refused(f"{where} is {e.kind}, not a regular file") from None
    except files.FileTooLargeError:
        raise _Refused(f"{where} is larger than {limit:,} bytes") from None
    except OSError as e:
        raise _Refused(f"{where} cannot be read ({e.strerror})") from None


def _why(error: Exception, seconds: float) -> str:
    """What went wrong with a report, in words that cannot hold the token;
    `seconds`: the time the report had."""
    if isinstance(error, _Refused):
        return str(error)
    if isinstance(error, ssl.SSLCertVerificationError):  # OpenSSL's words, the URL's host
        return f"its certificate is not trusted: {error.verify_message}"
    if isinstance(error, ssl.SSLError):
        return f"TLS failed: {error.reason or type(error).__name__}"
    if isinstance(error, TimeoutError):
        return f"no complete answer within {seconds:.1f} s"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, http.client.HTTPException):
        return f"not an HTTP answer ({type(error).__name__})"
    return type(error).__name__


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):  # a console that went away (process/console.py)
        files.warn(message)
