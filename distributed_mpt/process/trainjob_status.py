"""Progress in the TrainJob's own status, for Kubeflow Trainer v2.2+ with its
`TrainJobStatus` feature gate: `kubectl get trainjob NAME -o
jsonpath='{.status.trainerStatus}'` then shows the progress percentage, the
time left and the latest loss and accuracy.

The controller injects KUBEFLOW_TRAINER_SERVER_URL (an HTTPS endpoint),
KUBEFLOW_TRAINER_SERVER_CA_CERT (its CA certificate) and
KUBEFLOW_TRAINER_SERVER_TOKEN (a bearer token file, rotated: read at every
request) into the pods (kubeflow/trainer, docs/user-guides/trainjob-
progress.md). The chief POSTs `{"trainerStatus": {"progressPercentage",
"estimatedRemainingSeconds", "metrics": [{"name", "value"}],
"lastUpdatedTime"}}` at most every MIN_SECONDS, from a thread of its own so
that a slow server never slows training. A report that fails is one warning,
never a failed run.
"""

import datetime
import json
import os
import ssl
import sys
import threading
import time
import urllib.request
from typing import Mapping, Optional

from distributed_mpt.errors import first_line, quoted

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
# The controller asks for no more than one update every 5 seconds.
MIN_SECONDS = 5.0
_TIMEOUT_SECONDS = 5.0


class TrainJobStatus:
    """Sends the newest progress to the TrainJob; `close()` sends the last."""

    def __init__(self, url: str, ca_cert: str, token_file: str):
        self._url, self._token_file = url, token_file
        self._tls = ssl.create_default_context(cafile=ca_cert)
        self._latest: Optional[dict] = None
        self._changed = threading.Condition()
        self._closing = False
        self._warned = False
        self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                        name="trainjob-status")
        self._thread.start()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ
                         ) -> Optional["TrainJobStatus"]:
        """A sender if Kubeflow Trainer injected its endpoint, else None."""
        values = [environ.get(name) for name in (URL_ENV, CA_CERT_ENV, TOKEN_ENV)]
        if not all(values):
            return None
        try:
            return cls(*values)
        except (OSError, ssl.SSLError) as e:  # a CA file that cannot be read
            _warn(f"TrainJob progress is not reported: {CA_CERT_ENV}={quoted(values[1])} "
                  f"cannot be used ({quoted(first_line(e))})")
            return None

    def update(self, progress_percent: float, eta_seconds: Optional[float],
               metrics: Mapping[str, float]) -> None:
        """Makes this the progress to send next (older unsent ones are dropped)."""
        status = {"progressPercentage": int(max(0, min(100, progress_percent))),
                  "metrics": [{"name": name, "value": f"{value:.6g}"}
                              for name, value in metrics.items()],
                  "lastUpdatedTime": datetime.datetime.now(datetime.timezone.utc)
                  .isoformat(timespec="seconds").replace("+00:00", "Z")}
        if eta_seconds is not None:
            status["estimatedRemainingSeconds"] = int(round(eta_seconds))
        with self._changed:
            self._latest = {"trainerStatus": status}
            self._changed.notify()

    def close(self, timeout: float = MIN_SECONDS + _TIMEOUT_SECONDS + 1) -> None:
        """Sends what is pending (the final progress, at most MIN_SECONDS
        later) and stops the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout)

    def _send_loop(self) -> None:
        last_sent = None
        while True:
            with self._changed:
                while self._latest is None and not self._closing:
                    self._changed.wait()
                if self._latest is None:
                    return
                # At most one request every MIN_SECONDS, the last one too.
                wait = MIN_SECONDS - (time.monotonic() - last_sent) if last_sent else 0
                if wait > 0:
                    if self._closing:
                        time.sleep(wait)  # the final progress, once it may be sent
                    else:
                        self._changed.wait(wait)
                        continue
                payload, self._latest = self._latest, None
            self._post(payload)
            last_sent = time.monotonic()

    def _post(self, payload: dict) -> None:
        try:
            with open(self._token_file) as f:  # rotated by Kubernetes: read every time
                token = f.read().strip()
            request = urllib.request.Request(
                self._url, data=json.dumps(payload).encode(), method="POST",
                headers={"Authorization": f"Bearer {token}",
                         "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=_TIMEOUT_SECONDS,
                                        context=self._tls) as response:
                response.read()
        except Exception as e:  # noqa: BLE001 - reporting must never stop a run
            if not self._warned:  # once: a server that is down stays down
                self._warned = True
                _warn(f"TrainJob progress not reported to {quoted(self._url)} "
                      f"({type(e).__name__}: {quoted(first_line(e))}); training goes on")


def _warn(message: str) -> None:
    try:
        print(f"warning: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a console that went away (process/console.py)
        pass
