"""The TrainJob progress reporter (distributed_mpt/cluster/trainjob_progress.py)
against a real local HTTPS server with a CA and a certificate of its own
(tests/support/status_server.py): answering as Kubeflow Trainer's controller does,
the server gets every report with the bearer token; answering with an
endless body or endless headers, a trickle, a redirect to http://, a 401,
a status line that quotes the token, garbage for a TLS handshake or a
certificate of another CA, it costs one warning line, bounded time and
bounded memory, and the token is sent nowhere else and printed nowhere,
not a part of it. So are token and CA files that are not what the
controller mounts, and URLs that are not https. One run of the real entry
point trains to its final checkpoint against a hostile server; another,
stopped by SIGTERM while the server holds a report, does not wait for it."""

import contextlib
import http.client
import json
import os
import secrets
import signal
import socket
import ssl
import threading
import time
from typing import Tuple

import jsonschema
import pytest

from conftest import (SMOKE_FLAGS, WatchedProcess, assert_ok, make_path, read_summary,
                      run_module, subprocess_env)
from distributed_mpt import files
from distributed_mpt.cluster import trainjob_progress
from distributed_mpt.cluster.trainjob_progress import (
    CLOSE_SECONDS, MAX_ANSWER_BYTES, REQUEST_SECONDS, TrainJobStatus)
from support.netns import checkpointed_step
from support.status_server import Listener, StatusServer, echo, trainer_status_schema

# Random, so that any piece of it found in the output was printed, not typed.
TOKEN = secrets.token_urlsafe(32)
# What an "endless" answer sends at most, however much is read: 256 MiB,
# 4,096 times what the reporter may read.
ENDLESS_BYTES = 1 << 28
# close() on a machine shared with training runs: its bound, and room.
CLOSE_ROOM_SECONDS = CLOSE_SECONDS + 10


@pytest.fixture
def serve(tmp_path):
    """Starts StatusServer(answer) on 127.0.0.1, each with certificates of
    its own; all are stopped after the test."""
    with contextlib.ExitStack() as servers:
        def start(answer=None):
            directory = tmp_path / f"controller-{len(list(tmp_path.glob('controller-*')))}"
            directory.mkdir()
            return servers.enter_context(StatusServer("127.0.0.1", directory, answer, TOKEN))
        yield start


def report(env, capfd):
    """One report as the chief sends it, then close(), within its bound: the
    lines of stderr about the TrainJob, and the whole output."""
    status = TrainJobStatus.from_environment(env)
    assert status is not None, capfd.readouterr().err
    status.update(50, 60.4, {"loss": 1.5, "accuracy": 0.25})
    out, err = close(status, capfd)
    assert all(line.startswith("warning: ") for line in err.splitlines()), err
    return [line for line in err.splitlines() if "TrainJob" in line], out + err


def close(status: TrainJobStatus, capfd) -> Tuple[str, str]:
    """status.close(), which must return within its bound, its thread ended
    (a join that merely timed out returns in time too); the output until then."""
    began = time.monotonic()
    status.close()
    seconds = time.monotonic() - began
    out, err = capfd.readouterr()
    print(f"close() took {seconds:.2f} s (its bound: {CLOSE_SECONDS:g} s)")
    assert seconds < CLOSE_ROOM_SECONDS
    assert not status._thread.is_alive(), "close() returned with the reporter still running"
    return out, err


def assert_one_warning(lines, fragment):
    assert len(lines) == 1 and lines[0].startswith("warning: ") and fragment in lines[0], lines


def assert_no_part_of_the_token(output, token=TOKEN):
    """Not the token, nor any 6 characters of it in a row (its start and its
    end included)."""
    leaked = {token[i:i + 6] for i in range(len(token) - 5)} & {
        output[i:i + 6] for i in range(len(output) - 5)}
    assert not leaked, (leaked, output)


def test_the_controller_gets_each_report_with_the_token(serve, capfd):
    server = serve()
    # Kubernetes writes the token without a newline; a file a person wrote has one.
    with open(server.env["KUBEFLOW_TRAINER_SERVER_TOKEN"], "a") as f:
        f.write("\n")
    warnings, output = report(server.env, capfd)
    assert not warnings
    assert_no_part_of_the_token(output)
    ((_, headers, body),) = server.requests
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Content-Type"] == "application/json"
    status = json.loads(body)["trainerStatus"]
    jsonschema.validate(status, trainer_status_schema())
    assert (status["progressPercentage"], status["estimatedRemainingSeconds"]) == (50, 60)
    assert status["metrics"] == [{"name": "loss", "value": "1.5"},
                                 {"name": "accuracy", "value": "0.25"}]


def test_an_eta_beyond_the_status_field_is_sent_as_its_largest_value(serve, capfd):
    # estimatedRemainingSeconds is an int32 in the TrainJob CRD: a larger ETA
    # (a --train_steps of decades) was refused by the controller, every report.
    server = serve()
    status = TrainJobStatus.from_environment(server.env)
    status.update(0, 1e12, {"loss": 2.0})
    close(status, capfd)
    ((_, _, body),) = server.requests
    assert json.loads(body)["trainerStatus"]["estimatedRemainingSeconds"] == 2**31 - 1


def test_http_debugging_turned_on_in_the_process_prints_no_token(serve, capfd, monkeypatch):
    """The usual way to see a Python program's HTTP, turned on by a module
    the run imports (a user's --model file, say): http.client printed each
    request's headers, the Authorization header with them."""
    monkeypatch.setattr(http.client.HTTPConnection, "debuglevel", 1)
    server = serve()
    warnings, output = report(server.env, capfd)
    assert_no_part_of_the_token(output)
    assert not warnings and len(server.requests) == 1


class EndlessBody:
    """200, then a body without end (up to ENDLESS_BYTES); records how much
    of it each connection took before it hung up."""

    def __init__(self):
        self.sent = []

    def __call__(self, handler, number):
        handler.send_response(200)
        handler.end_headers()
        chunk, sent = b"0" * (1 << 16), 0
        try:
            while sent < ENDLESS_BYTES:
                handler.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the reporter hung up
            pass
        self.sent.append(sent)


def endless_headers(handler, number):
    handler.send_response(200)
    handler.flush_headers()
    with contextlib.suppress(OSError):
        for i in range(ENDLESS_BYTES // 16):
            handler.wfile.write(b"X-Again: %08d\r\n" % i)


def unauthorized(handler, number):
    """401, its reason phrase and body the token the request carried."""
    handler.send_response(401, handler.headers["Authorization"])
    handler.end_headers()
    handler.wfile.write(handler.headers["Authorization"].encode())


def token_in_the_status_line(handler, number):
    handler.wfile.write(f"HTTP/1.1 2OO {handler.headers['Authorization']}\r\n\r\n".encode())


@pytest.mark.parametrize("answer, fragment", [
    (EndlessBody(), f"it answered with more than {MAX_ANSWER_BYTES:,} bytes"),
    (endless_headers, "not an HTTP answer"),
    (unauthorized, "it answered 401)"),
    (token_in_the_status_line, "not an HTTP answer (BadStatusLine)"),
], ids=["endless body", "endless headers", "401 quoting the token", "token in status line"])
def test_a_hostile_answer_costs_one_warning(serve, capfd, answer, fragment):
    server = serve(answer)
    # A query may hold a credential too: the warning names the URL without it.
    warnings, output = report({**server.env, "KUBEFLOW_TRAINER_SERVER_URL":
                               server.env["KUBEFLOW_TRAINER_SERVER_URL"] + "?key=S3CRET"}, capfd)
    assert_one_warning(warnings, fragment)
    assert_no_part_of_the_token(output)
    assert "S3CRET" not in output and "?..." in warnings[0]
    assert len(server.requests) == 1
    if isinstance(answer, EndlessBody):
        assert_hung_up_early(answer)


def assert_hung_up_early(endless: EndlessBody) -> None:
    """What the server got into the sockets' buffers before the reporter
    hung up, each time: the reporter read at most MAX_ANSWER_BYTES of it."""
    deadline = time.monotonic() + 60
    while not endless.sent and time.monotonic() < deadline:  # the server's last write to fail
        time.sleep(0.1)
    print(f"the endless body: {endless.sent} bytes sent before the reporter hung up")
    assert endless.sent and max(endless.sent) < 32 << 20


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_is_never_followed(serve, capfd, status):
    elsewhere = Listener()

    def redirect(handler, number):
        handler.send_response(status)
        handler.send_header("Location", f"http://127.0.0.1:{elsewhere.port}/status")
        handler.end_headers()
    try:
        server = serve(redirect)
        warnings, output = report(server.env, capfd)
        time.sleep(0.5)  # for a connection made at the end of close()
        assert not elsewhere.received, elsewhere.received
    finally:
        elsewhere.close()
    assert_one_warning(warnings, f"it answered {status}, a redirect")
    assert_no_part_of_the_token(output)


def held(handler, number):
    """200, then the answer a byte a second: the report is held to its end."""
    handler.send_response(200)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    with contextlib.suppress(OSError):
        for _ in range(60):
            handler.wfile.write(b" ")
            time.sleep(1)


def test_a_trickling_server_holds_neither_the_thread_nor_the_final_report(serve, capfd):
    """The first request's answer comes a byte a second (each socket read
    well within any per-read timeout); the final report must still go, in
    close()'s bound."""
    hung_up_after = []

    def trickle_first(handler, number):
        if number > 0:
            return echo(handler, number)
        began = time.monotonic()
        held(handler, number)
        hung_up_after.append(time.monotonic() - began)

    server = serve(trickle_first)
    status = TrainJobStatus.from_environment(server.env)
    status.update(10, 90, {"loss": 2.0})
    time.sleep(2)  # the first report is under way, trickled
    status.update(100, 0, {"loss": 0.5})
    _, err = close(status, capfd)
    cut_by = time.monotonic() + 60  # the server's next write to fail, after close()
    while not hung_up_after and time.monotonic() < cut_by:
        time.sleep(0.1)
    print(f"the trickle was cut after {hung_up_after} s")
    assert len(server.requests) == 2, "the final report was sent"
    assert json.loads(server.requests[1][2])["trainerStatus"]["progressPercentage"] == 100
    assert hung_up_after and hung_up_after[0] < REQUEST_SECONDS + 10
    warnings = [line for line in err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, "no complete answer within 5.0 s")
    assert_no_part_of_the_token(err)


def test_a_slow_answer_leaves_the_final_report_its_turn(serve, capfd):
    """The first report is answered after nearly all of its REQUEST_SECONDS;
    the final one, given while the first is under way, must still go within
    close()'s bound. (Its turn, counted from the first one's answer, came
    too late for close()'s deadline: the 100% was never sent.)"""
    def slow_first(handler, number):
        if number == 0:
            time.sleep(REQUEST_SECONDS - 0.5)
        with contextlib.suppress(OSError):  # the reporter may have given up on it
            echo(handler, number)

    server = serve(slow_first)
    status = TrainJobStatus.from_environment(server.env)
    status.update(10, 90, {"loss": 2.0})
    arrived_by = time.monotonic() + 60
    while not server.requests and time.monotonic() < arrived_by:
        time.sleep(0.02)
    assert server.requests, "the first report arrived"
    status.update(100, 0, {"loss": 0.5})
    _, err = close(status, capfd)
    print(err)
    assert len(server.requests) == 2, "the final report was sent"
    assert json.loads(server.requests[1][2])["trainerStatus"]["progressPercentage"] == 100
    assert "no time left" not in err


def test_a_rotated_token_and_ca_certificate_are_used_from_the_next_report(serve, capfd,
                                                                          tmp_path):
    """The kubelet renews the token, and the CA when the controller's
    certificate is renewed: the CA was read once at the start, and every
    report after its renewal failed, untrusted, to the end of the run."""
    server = serve()
    status = TrainJobStatus.from_environment(server.env)
    status.update(10, 90, {"loss": 2.0})
    arrived_by = time.monotonic() + 60
    while not server.requests and time.monotonic() < arrived_by:
        time.sleep(0.05)
    renewed = serve()  # a new CA, and a certificate it signed for the same address
    server._http.socket.context.load_cert_chain(  # for its next connections
        tmp_path / "controller-1" / "server.crt", tmp_path / "controller-1" / "server.key")
    os.replace(renewed.env["KUBEFLOW_TRAINER_SERVER_CA_CERT"],
               server.env["KUBEFLOW_TRAINER_SERVER_CA_CERT"])
    new_token = secrets.token_urlsafe(32)
    (tmp_path / "new-token").write_text(new_token)
    os.replace(tmp_path / "new-token", server.env["KUBEFLOW_TRAINER_SERVER_TOKEN"])
    status.update(100, 0, {"loss": 0.5})
    _, err = close(status, capfd)
    assert [line for line in err.splitlines() if "TrainJob" in line] == []
    assert len(server.requests) == 2, "the final report was sent"
    assert server.requests[1][1]["Authorization"] == f"Bearer {new_token}"


def test_the_ca_is_parsed_again_only_once_kubernetes_rotated_it(serve, capfd, tmp_path,
                                                                monkeypatch):
    """The CA bundle was read and parsed again at every report: 240 ms for
    1 MiB, the GIL held, a training thread's time. Kubernetes rotates it as
    it does every projected file: a new directory, the ..data link swapped."""
    def mounted(name: str, ca_file: str) -> None:  # the kubelet's atomic writer
        (tmp_path / "mount" / name).mkdir(parents=True)
        (tmp_path / "mount" / name / "ca.crt").write_bytes(open(ca_file, "rb").read())
        os.symlink(name, tmp_path / "mount" / "..data_tmp")
        os.replace(tmp_path / "mount" / "..data_tmp", tmp_path / "mount" / "..data")

    parsed, real_load = [], ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda *args, **kwargs: parsed.append(1) or real_load(*args, **kwargs))
    monkeypatch.setattr(trainjob_progress, "MIN_SECONDS", 0.2)  # reports in a row, quickly
    server, renewed = serve(), serve()
    mounted("..2026_12_06_20_00_00.1", server.env["KUBEFLOW_TRAINER_SERVER_CA_CERT"])
    os.symlink("..data/ca.crt", tmp_path / "mount" / "ca.crt")
    status = TrainJobStatus.from_environment(
        {**server.env, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tmp_path / "mount" / "ca.crt")})

    def reported(progress: int) -> None:
        status.update(progress, 90, {"loss": 2.0})
        arrived_by = time.monotonic() + 60
        while len(server.requests) < progress and time.monotonic() < arrived_by:
            time.sleep(0.02)
        assert len(server.requests) == progress, capfd.readouterr().err
    reported(1)
    reported(2)
    assert len(parsed) == 1, "the unchanged CA is not parsed again"
    server._http.socket.context.load_cert_chain(  # renewed, for its next connections
        tmp_path / "controller-1" / "server.crt", tmp_path / "controller-1" / "server.key")
    mounted("..2026_12_06_21_00_00.2", renewed.env["KUBEFLOW_TRAINER_SERVER_CA_CERT"])
    reported(3)
    _, err = close(status, capfd)
    assert [line for line in err.splitlines() if "TrainJob" in line] == []
    assert len(parsed) == 2, "the rotated CA is parsed once"


@pytest.fixture
def addresses_of(monkeypatch):
    """`addresses_of(name, ports)`: the name resolves to 127.0.0.1 at each of
    `ports`, or, without ports, never resolves (`addresses_of.asked` is set
    once it is looked up); released after the test."""
    real, names, released = socket.getaddrinfo, {}, threading.Event()

    def getaddrinfo(host, *args, **kwargs):
        if host not in names:
            return real(host, *args, **kwargs)
        if names[host] is None:
            resolve.asked.set()
            released.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))
                for port in names[host]]
    def resolve(name, ports=None):
        names[name] = ports
    resolve.asked = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield resolve
    released.set()


def unanswered_port(stack: contextlib.ExitStack) -> int:
    """A port on 127.0.0.1 whose connections never complete: its listener's
    queue is full, and the kernel drops their SYNs."""
    listener = stack.enter_context(socket.socket())
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    for _ in range(3):
        filler = stack.enter_context(socket.socket())
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
    return listener.getsockname()[1]


def test_a_report_to_a_name_of_many_unanswering_addresses_ends_in_time(serve, capfd,
                                                                        addresses_of):
    """Each address had the whole REQUEST_SECONDS to connect: 4 of them held
    the report for 20 s, close() gave up on it, and no warning was printed."""
    with contextlib.ExitStack() as stack:
        addresses_of("status.example", [unanswered_port(stack)] * 4)
        server = serve()
        warnings, output = report(
            {**server.env, "KUBEFLOW_TRAINER_SERVER_URL": "https://status.example/status"}, capfd)
    assert_one_warning(warnings, f"no complete answer within {REQUEST_SECONDS:.1f} s")
    assert_no_part_of_the_token(output)


def test_a_report_reaches_the_address_that_answers_after_one_that_never_does(serve, capfd,
                                                                              addresses_of):
    """The first address (a dead IPv6 one on a network of IPv4, say) took the
    report's whole time, and the one that answers was never tried."""
    with contextlib.ExitStack() as stack:
        server = serve()
        addresses_of(server.NAME, [unanswered_port(stack), server.port])
        warnings, _ = report({**server.env, "KUBEFLOW_TRAINER_SERVER_URL":
                              f"https://{server.NAME}:{server.port}/apis/status"}, capfd)
    assert warnings == [] and len(server.requests) == 1, warnings


def test_an_address_this_kernel_cannot_open_a_socket_for_is_passed_over(serve, capfd,
                                                                         monkeypatch):
    """A name's first address of a kind this kernel has no socket for (an
    IPv6 address where IPv6 is turned off; here a protocol it lacks) ended
    the report there: the address that answers was never tried."""
    server, real = serve(), socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host != server.NAME:
            return real(host, *args, **kwargs)
        address = ("127.0.0.1", server.port)
        return [(socket.AF_INET, socket.SOCK_STREAM, protocol, "", address)
                for protocol in (253, socket.IPPROTO_TCP)]  # 253: no such protocol here
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    warnings, _ = report({**server.env, "KUBEFLOW_TRAINER_SERVER_URL":
                          f"https://{server.NAME}:{server.port}/apis/status"}, capfd)
    assert warnings == [] and len(server.requests) == 1, warnings


def test_a_name_that_never_resolves_is_a_warning_at_the_end(serve, capfd, addresses_of,
                                                             monkeypatch):
    """No deadline reaches a name's resolution: close() returns in its bound
    all the same, and says the final progress was not sent (it said nothing)."""
    monkeypatch.setattr(trainjob_progress, "CLOSE_SECONDS", 2.0)
    addresses_of("status.example")
    status = TrainJobStatus.from_environment(
        {**serve().env, "KUBEFLOW_TRAINER_SERVER_URL": "https://status.example/status"})
    status.update(100, 0, {"loss": 0.5})
    assert addresses_of.asked.wait(30)
    began = time.monotonic()
    status.close()
    assert time.monotonic() - began < 2.0 + 10
    warnings = [line for line in capfd.readouterr().err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, "the final progress was not sent within 2 s")


def test_garbage_for_a_handshake_or_another_ca_certificate(serve, capfd):
    garbage = Listener(reply=b"HTTP/1.1 200 OK\r\n\r\n" + os.urandom(4096))
    ours, theirs = serve(), serve()
    try:
        warnings, output = report(
            {**ours.env, "KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{garbage.port}/"},
            capfd)
        assert_one_warning(warnings, "TLS failed")
    finally:
        garbage.close()
    warnings, output_too = report({**ours.env, "KUBEFLOW_TRAINER_SERVER_URL": theirs.url}, capfd)
    assert_one_warning(warnings, "its certificate is not trusted")
    assert not theirs.requests
    assert_no_part_of_the_token(output + output_too)


@pytest.mark.parametrize("url, fragment", [
    ("http://127.0.0.1:{port}/status", "is not an https:// URL"),
    ("HTTP://127.0.0.1:{port}/status", "is not an https:// URL"),
    ("file:///dev/zero", "is not an https:// URL"),
    ("https://someone:S3CRET@127.0.0.1:{port}/", "=https://...@127.0.0.1"),
    ("https://127.0.0.1:{port}/status\n", "holds a space, a control character"),
    ("https://ex\u00e4mple.com/", "its xn-- form"),
    ("http://127.0.0.1:{port}/status?access_token=S3CRET", "/status?... is not an https"),
])
def test_only_an_https_url_is_used(serve, capfd, url, fragment):
    listener = Listener()
    try:
        env = {**serve().env, "KUBEFLOW_TRAINER_SERVER_URL": url.format(port=listener.port)}
        assert TrainJobStatus.from_environment(env) is None
        time.sleep(0.5)
        assert not listener.received, "nothing is sent"
    finally:
        listener.close()
    warnings = [line for line in capfd.readouterr().err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, fragment)
    assert "S3CRET" not in warnings[0], "a password or a query in the URL is not echoed"


@pytest.mark.parametrize("url", [
    "https://user:S3CRET@host/status", "https://user:p/S3CRET@host/", "https://user:p?S3CRET@host/",
    "https:user:S3CRET@host/", "user:S3CRET@host/x", "https://host/status?token=S3CRET",
    "https://host/status#S3CRET"])
def test_a_url_is_named_without_what_may_be_a_credential(url):
    from distributed_mpt.cluster.trainjob_progress import _shown

    assert "S3CRET" not in _shown(url)


@pytest.mark.parametrize("unset", [["KUBEFLOW_TRAINER_SERVER_CA_CERT"],
                                   ["KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_TOKEN"]])
def test_an_endpoint_without_all_its_variables_is_a_warning(serve, capfd, unset):
    """The variables set by hand, one left out or empty: no report, and
    nothing said of it (the run looked as if it reported)."""
    server = serve()
    env = {**server.env, unset[0]: ""}
    for name in unset[1:]:
        del env[name]
    assert TrainJobStatus.from_environment(env) is None
    warnings = [line for line in capfd.readouterr().err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, f"{' and '.join(unset)} {'is' if len(unset) == 1 else 'are'} "
                                 f"not set or empty")
    assert not server.requests
    assert TrainJobStatus.from_environment({}) is None  # no endpoint at all: nothing to say
    assert capfd.readouterr().err == ""


def test_a_failure_no_one_foresaw_is_a_warning_not_a_failed_run(serve, capfd, monkeypatch):
    """Reading the CA once failed with a TypeError (a kernel file that had
    nothing to read): the run ended in a traceback."""
    def unforeseen(path, limit):
        raise TypeError("object of type 'NoneType' has no len()")

    monkeypatch.setattr(files, "read_bounded", unforeseen)
    assert TrainJobStatus.from_environment(serve().env) is None
    warnings = [line for line in capfd.readouterr().err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, "TrainJob progress is not reported: TypeError")


def test_a_report_failing_in_saying_why_prints_no_traceback_that_quotes_the_server(
        serve, capfd, monkeypatch):
    """Memory exhausted (or a bug) while a failed report's warning was made,
    after a server quoted the token in its status line: the thread's default
    hook printed a traceback, and in its context http.client's error, which
    quotes that line, the token with it."""
    def exhausted(*args):
        raise MemoryError()

    monkeypatch.setattr(trainjob_progress, "_why", exhausted)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # not pytest's
    warnings, output = report(serve(token_in_the_status_line).env, capfd)
    assert "Traceback" not in output
    assert_no_part_of_the_token(output)
    assert_one_warning(warnings, "its thread failed (MemoryError)")


def _file_of_kind(path, kind: str, contents: dict):
    """`path` made a file of `contents[kind]`, or a path of `kind` (conftest.make_path)."""
    if kind not in contents:
        return make_path(kind, path)
    path.write_text(contents[kind])
    return path


@pytest.mark.parametrize("kind, fragment", [
    ("FIFO", "is a FIFO, not a regular file"),
    ("device", "is a device node, not a regular file"),
    ("newline inside", "does not hold a bearer token"),
    ("not ASCII", "does not hold a bearer token"),
    ("huge", "is larger than 65,536 bytes"),
    ("empty", "is empty"),
])
def test_a_token_file_that_holds_no_token(serve, capfd, tmp_path, kind, fragment):
    server = serve()
    path = _file_of_kind(tmp_path / "token", kind, {
        "newline inside": f"{TOKEN[:20]}\n{TOKEN[20:]}", "not ASCII": f"{TOKEN}\u00e9",
        "huge": TOKEN * 2000, "empty": ""})
    warnings, output = report({**server.env, "KUBEFLOW_TRAINER_SERVER_TOKEN": str(path)}, capfd)
    assert_one_warning(warnings, fragment)
    assert not server.requests
    assert_no_part_of_the_token(output)


def test_a_token_given_in_place_of_its_file_is_never_printed(serve, capfd):
    """KUBEFLOW_TRAINER_SERVER_TOKEN set to the token itself, not to its
    file's path: the warning quoted the variable's value, the whole token."""
    server = serve()
    warnings, output = report({**server.env, "KUBEFLOW_TRAINER_SERVER_TOKEN": TOKEN}, capfd)
    assert_no_part_of_the_token(output)
    assert_one_warning(warnings, "the file KUBEFLOW_TRAINER_SERVER_TOKEN names cannot be read")
    assert not server.requests


@pytest.mark.parametrize("kind, fragment", [
    ("FIFO", "is a FIFO, not a regular file"),
    ("device", "is a device node, not a regular file"),
    ("huge", "is larger than 1,048,576 bytes"),
    ("empty", "is not a PEM certificate"),
    ("not a certificate", "is not a PEM certificate"),
])
def test_a_ca_file_that_holds_no_ca_certificate(serve, capfd, tmp_path, kind, fragment):
    server = serve()
    path = _file_of_kind(tmp_path / "ca.crt", kind, {
        "huge": "-" * (2 << 20), "empty": "", "not a certificate": "-----BEGIN CERTIFICATE-----\n"})
    made = []
    start = threading.Thread(target=lambda: made.append(TrainJobStatus.from_environment(
        {**server.env, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(path)})), daemon=True)
    start.start()
    start.join(30)
    assert made == [None], "refused, without waiting"
    warnings = [line for line in capfd.readouterr().err.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, fragment)


@pytest.mark.slow
def test_a_run_finishes_to_its_final_checkpoint_whatever_the_server_does(serve, tmp_path):
    """The real entry point, with the variables the controller injects,
    against a server that answers each report in a worse way."""
    elsewhere = Listener()

    def redirect(handler, number):
        handler.send_response(302)
        handler.send_header("Location", f"http://127.0.0.1:{elsewhere.port}/")
        handler.end_headers()
    endless = EndlessBody()
    answers = [endless, redirect, unauthorized, token_in_the_status_line]
    server = serve(lambda handler, number: answers[number % len(answers)](handler, number))
    model_dir = tmp_path / "run"
    try:
        result = run_module("distributed_mpt.train", [
            *SMOKE_FLAGS, "--train_steps=30", "--log_every_steps=5", f"--model_dir={model_dir}"],
            timeout=900, env=subprocess_env(**server.env))
    finally:
        elsewhere.close()
    assert_ok(result)
    assert read_summary(model_dir)["steps"] == checkpointed_step(model_dir) == 30
    print(f"{len(server.requests)} reports")
    assert server.requests and not elsewhere.received
    assert_hung_up_early(endless)
    warnings = [line for line in result.stderr.splitlines() if "TrainJob" in line]
    assert_one_warning(warnings, "not reported to")
    assert_no_part_of_the_token(result.stdout + result.stderr)


def test_an_early_close_leaves_a_held_report_and_says_nothing_of_it(serve, capfd):
    """close(early=True), a run stopped or failed, while the server holds a
    report: it returns within its short bound; the report left behind ends
    by itself, unsaid (the run's own output says why it ends)."""
    server = serve(held)
    status = TrainJobStatus.from_environment(server.env)
    status.update(10, 90, {"loss": 2.0})
    arrived_by = time.monotonic() + 60
    while not server.requests and time.monotonic() < arrived_by:
        time.sleep(0.02)
    status.update(20, 80, {"loss": 1.0})
    began = time.monotonic()
    status.close(early=True)
    seconds = time.monotonic() - began
    with capfd.disabled():
        print(f"close(early=True) took {seconds:.2f} s")
    assert seconds < CLOSE_SECONDS / 2  # a normal close waits for it: 10 s
    status._thread.join(REQUEST_SECONDS + 30)
    assert not status._thread.is_alive() and len(server.requests) == 1
    assert "TrainJob" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_stopped_run_does_not_wait_for_the_report_the_server_holds(serve, tmp_path):
    """SIGTERM while the server holds a report: the run exits 143 with its
    checkpoint, without spending its pod's grace period (20 s by the
    launcher's default) on progress. It waited for the report held, then
    gave the next one its turn and its 5 s: 8.7 s after its checkpoint line
    (9.1 after the signal), and 2.3 s since (2 cores of a Zen 5 EPYC)."""
    server = serve(held)
    model_dir = tmp_path / "run"
    run = WatchedProcess("distributed_mpt.train", [
        *SMOKE_FLAGS, "--train_steps=100000", "--steps_per_loop=2", "--log_every_steps=2",
        "--checkpoint_every_steps=100000", "--noevaluate", f"--model_dir={model_dir}"],
        env=subprocess_env(**server.env))
    try:
        arrived_by = time.monotonic() + 300
        while not server.requests and time.monotonic() < arrived_by:
            time.sleep(0.05)
        assert server.requests, run.output()[-2000:]
        time.sleep(1)  # the progress logged meanwhile waits for its turn
        signalled = time.monotonic()
        run.process.send_signal(signal.SIGTERM)
        saved, _ = run.wait_for(r"stopped by a signal at step \d+; checkpoint saved", 120)
        code = run.finish(timeout=120)
        ended = time.monotonic()
    finally:
        run.process.kill()
    print(f"exit {code}: {ended - signalled:.1f} s after SIGTERM, {ended - saved:.1f} s after "
          f"the checkpoint (a finished run's close: at most {CLOSE_SECONDS:g} s)")
    assert code == 143, run.output()[-2000:]
    assert checkpointed_step(model_dir) > 0 and "Traceback" not in run.output()
    # 3x the 2.3 s measured, for a loaded machine; below the 8.7 s of a close that waits.
    assert ended - saved < 7.0, run.output()[-2000:]
