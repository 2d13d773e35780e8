"""Files a run leaves in --model_dir, each written whole or not at all.

A reader (a user, a dashboard, the next run) never sees half a file: each is
written under a temporary name in the same directory and renamed into place,
which is atomic on POSIX file systems.
"""

import json
import os
import shutil
import tempfile
import uuid

from distributed_mpt.errors import ConfigError


def check_writable(directory: str, flag: str = "--model_dir") -> None:
    """Creates `directory` if needed and proves it writable, or raises
    ConfigError naming `flag`, the flag that chose it."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}={directory} is not writable ({e.strerror}); "
                          f"choose a directory you can write to") from None


def write_json(path: str, data) -> None:
    """Writes `data` as pretty JSON to `path` atomically."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` atomically (temporary file, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".tmp-", delete=False) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    # Temporary files are private (0600); the result is for everyone the
    # umask allows, like any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)
    os.replace(f.name, path)


def read_jsonl(path: str) -> list:
    """The records of a JSON-lines file (empty if it does not exist). A last
    line cut short by a killed writer is dropped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn line: what was appended when the process died
    return records


def export_model(model, model_dir: str) -> str:
    """Exports `model` to `<model_dir>/export/`: `saved_model/` for TF Serving
    and `model.keras` for Keras. The new export replaces the old one only once
    it is complete."""
    final = os.path.join(model_dir, "export")
    staging = os.path.join(model_dir, f".export-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        model.export(os.path.join(staging, "saved_model"), format="tf_saved_model", verbose=False)
        model.save(os.path.join(staging, "model.keras"))
        if os.path.exists(final):
            retired = f"{staging}-old"
            os.replace(final, retired)
            os.replace(staging, final)
            shutil.rmtree(retired)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
