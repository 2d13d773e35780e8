"""Running the package's entry points (and the memory probes) as child
processes: their environment, a timed run, the last line of their errors."""

import os
import subprocess
from typing import List


SUBPROCESS_TIMEOUT = 900


def subprocess_environment() -> dict:
    environment = dict(os.environ)
    environment.pop("TF_CONFIG", None)  # each run is its own single- or multi-worker job
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    return environment


def run_command(command: List[str], timeout: float = SUBPROCESS_TIMEOUT):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_environment())


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
