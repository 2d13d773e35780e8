"""How much more memory this process may take before it is killed.

The lower of the host's MemAvailable and what the memory limit of the
process's cgroup leaves: a container's, a pod's, a SLURM job's (cgroup v2
`memory.max` less `memory.current`; v1 `memory.limit_in_bytes` less
`memory.usage_in_bytes`; each less the inactive page cache, which the kernel
reclaims before it kills), in the process's own cgroup and in every cgroup
above it, whose limits bind it too. /proc/meminfo shows none of them: a pod
limited to 4 GB on a host with 500 GB free sees 500 GB, and the OOM killer
ends it at 4 (exit 137, which restart policies retry) without a word.

Linux only; elsewhere, or where nothing can be read, there is no figure and
no check. `root` lets a test point the probe at a tree of its own.
"""

import contextlib
import dataclasses
import os
import re
from typing import List, Optional

# cgroup v1 writes "no limit" as the largest page-aligned int64.
_UNLIMITED = 2**60


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Bytes this process may still take, and the limit that says so."""

    bytes: int
    limit: str  # e.g. "available on this host (MemAvailable)"

    def describe(self) -> str:
        return f"{self.bytes / 1e9:.1f} GB {self.limit}"


def headroom(root: str = "/") -> Optional[Headroom]:
    """The tightest of the host's and the cgroups' headroom; None where
    nothing can be read (not Linux)."""
    candidates = _cgroup_headrooms(root)
    available = _meminfo_available(root)
    if available is not None:
        candidates.append(Headroom(available, "available on this host (MemAvailable)"))
    return min(candidates, key=lambda h: h.bytes, default=None)


def _read(root: str, path: str) -> str:
    with open(os.path.join(root, path.lstrip("/"))) as f:
        return f.read(1 << 20)


def _meminfo_available(root: str) -> Optional[int]:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in _read(root, "proc/meminfo").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _unescape(field: str) -> str:
    """A mountinfo path: spaces and the like are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_headrooms(root: str) -> List[Headroom]:
    try:
        memberships = [line.split(":", 2) for line in _read(root, "proc/self/cgroup").splitlines()]
        mounts = _read(root, "proc/self/mountinfo").splitlines()
    except OSError:
        return []
    found = []
    for line in mounts:
        fields = line.split()
        if "-" not in fields[6:] or len(fields) < 10:
            continue
        dash = fields.index("-", 6)
        kind, options = fields[dash + 1], fields[dash + 3:dash + 4] or [""]
        if kind == "cgroup2":
            version = 2
        elif kind == "cgroup" and "memory" in options[0].split(","):
            version = 1
        else:
            continue
        for membership in memberships:
            if len(membership) != 3:
                continue
            hierarchy, controllers, path = membership
            if (version == 2 and hierarchy == "0") or \
                    (version == 1 and "memory" in controllers.split(",")):
                found += _along(root, _unescape(fields[3]), _unescape(fields[4]), path, version)
    return found


def _along(root: str, mount_root: str, mount_point: str, path: str, version: int):
    """The headroom under every limit from the cgroup at `path` up to the
    top of the hierarchy mounted at `mount_point`."""
    relative = os.path.relpath(path, mount_root)
    if relative.startswith(".."):  # in another cgroup namespace: the mount is our own
        relative = "."
    top = os.path.join(root, mount_point.lstrip("/"))
    directory = os.path.normpath(os.path.join(top, relative))
    if not os.path.isdir(directory):
        directory = top
    found = []
    while True:
        if (limit := _limit_in(directory, version)) is not None:
            name = "/" + os.path.relpath(directory, top).lstrip(".")
            found.append(Headroom(limit[0] - limit[1], f"left under the memory limit of cgroup "
                                  f"{name} ({limit[0] / 1e9:.1f} GB, {limit[2]})"))
        if os.path.normpath(directory) == os.path.normpath(top):
            return found
        directory = os.path.dirname(directory)


def _limit_in(directory: str, version: int):
    """(limit, bytes in use that the kernel cannot reclaim, the file naming
    the limit) of the cgroup `directory`; None if it sets no limit."""
    limit_file, usage_file, cache = (("memory.max", "memory.current", "inactive_file")
                                     if version == 2 else
                                     ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                      "total_inactive_file"))
    try:
        text = _read(directory, limit_file).strip()
        if text == "max" or int(text) >= _UNLIMITED:
            return None
        usage = int(_read(directory, usage_file).strip())
    except (OSError, ValueError):
        return None
    reclaimable = 0
    with contextlib.suppress(OSError, ValueError):
        for line in _read(directory, "memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if key == cache:
                reclaimable = int(value)
    return int(text), max(0, usage - reclaimable), limit_file


def release_freed_memory() -> bool:
    """Gives back to the system the memory this process has freed but glibc's
    allocator keeps for later (malloc_trim), so that the next phase of a run
    grows from what is in use, not from the last phase's peak. 12-step
    float32 runs of `cpu_cnn94_muon` with evaluation and export peaked at
    3.17-3.56 GB (4 runs) with their evaluation and export started from a
    trimmed heap, at 3.63-3.64 GB (2) without (2 cores of a 2.6 GHz Xeon;
    the peak varies with the order in which threads allocate). Python's
    cycles are collected first: TensorFlow's objects (a finished input
    pipeline, the arrays it shares) are often held in one. False where the
    C library has no malloc_trim (not glibc)."""
    import ctypes
    import gc

    gc.collect()  # what only Python's cycle collector would free (TensorFlow's objects)
    try:  # the C library the process runs on, whatever its file is called
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
