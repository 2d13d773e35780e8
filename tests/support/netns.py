"""Pods as processes: each in a network namespace of its own, joined to the
others by a bridge, with the hostname and the DNS names its cluster gives it.

`ip netns exec NAME` bind-mounts /etc/netns/NAME/hosts over /etc/hosts, so
names resolve in each namespace as the cluster's DNS would answer them; a
new UTS namespace (`unshare --uts`) carries the pod's hostname. Needs root;
`unavailable()` says why not, for a test to skip with.

Faults: a link cut, narrowed (tc tbf), delayed and lossy (tc netem, where
the kernel has it), or routed through a userspace forwarder that delays,
drops and stalls (tests/support/lossy_link.py: any kernel with TUN devices).
"""

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from conftest import SMALL_MODEL
from support.lossy_link import DEVICE

SUBNET = "10.231.{}.{}"  # a private /24 per network, far from common defaults


def unavailable() -> Optional[str]:
    """Why pods cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"dmpt-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def netem_unavailable() -> Optional[str]:
    """Why tc cannot add delay and loss here (no sch_netem in the kernel), or None."""
    probe = f"dmptq{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"], check=True)
    try:
        tc = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"],
                            capture_output=True, text=True)
        return None if tc.returncode == 0 else f"tc netem: {tc.stderr.strip()} (no sch_netem in this kernel)"
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


def tun_unavailable() -> Optional[str]:
    """Why tests/support/lossy_link.py cannot make its TUN devices here, or None."""
    return None if os.path.exists("/dev/net/tun") else "no /dev/net/tun (the tun module is not loaded)"


def _ip(*args, netns: Optional[str] = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True)


class Network:
    """A bridge and one namespace per pod. Use as a context manager; every
    forwarder, namespace, link and hosts file is removed on exit."""

    def __init__(self, hosts: Sequence[Sequence[str]]):
        """`hosts[i]` are the DNS names of pod i (first: its hostname)."""
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"dmptbr{tag}"
        self.namespaces = [f"dmpt-{tag}-{i}" for i in range(len(hosts))]
        self._veths = [f"dmpt{tag}v{i}" for i in range(len(hosts))]
        self._subnet = 16 + int(tag, 16) % 200
        self.addresses = [SUBNET.format(self._subnet, 10 + i) for i in range(len(hosts))]
        self._hosts = [list(names) for names in hosts]
        self._forwarders = []

    def __enter__(self):
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, netns in enumerate(self.namespaces):
                _ip("netns", "add", netns)
                _ip("link", "add", self._veths[i], "type", "veth", "peer", "name", "eth0", "netns", netns)
                _ip("link", "set", self._veths[i], "master", self.bridge, "up")
                _ip("addr", "add", f"{self.addresses[i]}/24", "dev", "eth0", netns=netns)
                _ip("link", "set", "eth0", "up", netns=netns)
                _ip("link", "set", "lo", "up", netns=netns)
                os.makedirs(f"/etc/netns/{netns}", exist_ok=True)
                with open(f"/etc/netns/{netns}/hosts", "w") as hosts:
                    hosts.write("127.0.0.1 localhost\n")
                    hosts.writelines(f"{address} {' '.join(names)}\n"
                                     for address, names in zip(self.addresses, self._hosts))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        # Forwarders first: their devices hold the namespaces alive, which
        # `ip netns del` would only unname.
        for forwarder in self._forwarders:
            forwarder.close()
        # The veths explicitly: a namespace's devices go when the kernel gets
        # round to freeing it, seconds after `ip netns del` at times.
        for veth, netns in zip(self._veths, self.namespaces):
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def host_address(self) -> str:
        """An address of this (the test's) namespace on the pods' bridge, for a
        service the pods reach outside the cluster (the Trainer controller's
        status endpoint, say)."""
        address = SUBNET.format(self._subnet, 1)
        subprocess.run(["ip", "addr", "add", f"{address}/24", "dev", self.bridge],
                       capture_output=True)  # once; a second call finds it there
        return address

    def popen(self, pod: int, command: List[str], env: Dict[str, str], **kwargs) -> subprocess.Popen:
        """Starts `command` in pod `pod`'s namespace under its hostname."""
        hostname = self._hosts[pod][0]
        wrapper = ["ip", "netns", "exec", self.namespaces[pod], "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', hostname]
        return subprocess.Popen([*wrapper, *command], env={**env, "HOSTNAME": hostname}, **kwargs)

    # -------------------------------------------------------------- faults

    def cut(self, pod: int) -> None:
        """Takes pod `pod`'s link down (a cable pulled, a node gone)."""
        _ip("link", "set", self._veths[pod], "down")

    def restore(self, pod: int) -> None:
        """Brings pod `pod`'s link back and removes any shaping."""
        _ip("link", "set", self._veths[pod], "up")
        for command in self._tc(pod, "del"):
            subprocess.run(command, capture_output=True)

    def degrade(self, pod: int, delay_ms: int, loss_percent: float) -> None:
        """Delays and drops pod `pod`'s packets both ways (tc netem on
        both ends of its link)."""
        for command in self._tc(pod, "replace", "netem", "delay", f"{delay_ms}ms",
                                "loss", f"{loss_percent}%"):
            subprocess.run(command, check=True, capture_output=True, text=True)

    def throttle(self, pod: int, kbit_per_second: int) -> None:
        """Limits pod `pod`'s link to a rate, both ways (tc tbf: a slow link
        where netem is not available)."""
        for command in self._tc(pod, "replace", "tbf", "rate", f"{kbit_per_second}kbit", "burst", "16kb",
                                "latency", "500ms"):
            subprocess.run(command, check=True, capture_output=True, text=True)

    def lossy_link(self, delay_ms: float, loss: float, pods=(0, 1)) -> "Forwarder":
        """Routes the two `pods` to each other through a userspace forwarder
        (tests/support/lossy_link.py) that delays each packet by `delay_ms` and drops
        the fraction `loss`, each way: netem's job on any kernel. It stays
        until the network is removed; `.stall(seconds)` holds the link."""
        forwarder = Forwarder([self.namespaces[pod] for pod in pods], delay_ms, loss)
        self._forwarders.append(forwarder)
        for pod, peer in (pods, pods[::-1]):
            netns, address, peer_address = self.namespaces[pod], self.addresses[pod], self.addresses[peer]
            # The same MTU as the bridge's path, so that full-size segments
            # of either path fit the other.
            mtu = json.loads(subprocess.run(["ip", "netns", "exec", netns, "ip", "-j", "link", "show", "eth0"],
                                            check=True, capture_output=True, text=True).stdout)[0]["mtu"]
            # A long queue: a forwarder kept waiting by a busy machine
            # delays packets rather than losing more than `loss`.
            _ip("link", "set", DEVICE, "mtu", str(mtu), "txqueuelen", "10000", "up", netns=netns)
            # A /32 beats the bridge's /24; no gateway and no ARP on a
            # point-to-point TUN device.
            _ip("route", "add", f"{peer_address}/32", "dev", DEVICE, "src", address, netns=netns)
            # Behind it, a blackhole: if the forwarder died, its device and
            # route would go and the pods lose each other, instead of
            # carrying on unseen over the clean bridge.
            _ip("route", "add", "blackhole", f"{peer_address}/32", "metric", "1000", netns=netns)
        return forwarder

    def _tc(self, pod: int, action: str, *qdisc) -> list:
        """The tc commands for both ends of pod `pod`'s link."""
        return [["tc", "qdisc", action, "dev", self._veths[pod], "root", *qdisc],
                ["ip", "netns", "exec", self.namespaces[pod], "tc", "qdisc", action, "dev", "eth0",
                 "root", *qdisc]]


class Forwarder:
    """A running tests/support/lossy_link.py between two namespaces."""

    def __init__(self, namespaces: Sequence[str], delay_ms: float, loss: float):
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("lossy_link.py")), *namespaces,
             f"--delay_ms={delay_ms}", f"--loss={loss}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._pending = b""
        try:
            ready = self._reply(timeout=60)
        except BaseException:
            self.close()
            raise
        if ready != "ready":
            self.close()
            raise RuntimeError(f"lossy_link.py did not start: {ready}")

    def stall(self, seconds: float) -> None:
        """Holds every packet, both ways, for `seconds` from now."""
        self._command(f"stall {seconds}")

    def stats(self) -> dict:
        """Packets read, dropped, delivered... in each direction so far."""
        return json.loads(self._command("stats"))

    def close(self) -> None:
        """Ends the forwarder (the end of its stdin), and with it its devices."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()

    def _command(self, line: str) -> str:
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()
        return self._reply(timeout=30)

    def _reply(self, timeout: float) -> str:
        """The next line it prints; fails if it ends or stays silent."""
        deadline = time.monotonic() + timeout
        out = self.process.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(out, 4096) if ready else None
            if not chunk:
                self.process.kill()
                raise RuntimeError(f"lossy_link.py {'ended' if chunk == b'' else 'stopped answering'}: "
                                   f"{self.process.stderr.read().decode()[-2000:]}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


# ------------------------------------------------------- pods as processes

TRAIN_STEPS = 20
CHECKPOINT_EVERY = 5
PEER_TIMEOUT_SECONDS = 60


def user_flags(model_dir) -> list:
    """What a user appends to try the job on CPUs in a minute."""
    return ["--dataset=synthetic", "--synthetic_examples=1024", *SMALL_MODEL, "--precision=float32",
            "--communication=ring", "--per_replica_batch_size=16", "--warmup_epochs=0",
            "--weight_decay=0", "--label_smoothing=0", f"--train_steps={TRAIN_STEPS}",
            "--steps_per_loop=5", "--log_every_steps=5", f"--checkpoint_every_steps={CHECKPOINT_EVERY}",
            "--noexport", f"--peer_timeout_seconds={PEER_TIMEOUT_SECONDS}", f"--model_dir={model_dir}"]


class Group:
    """One start of every pod of a job (what a JobSet restart, or the
    operator recreating its pods, starts)."""

    def __init__(self, network, pods, model_dir: Path, scratch: Path, flags: Sequence[str] = ()):
        """Starts every pod with `user_flags(model_dir)`, then `flags` (the last of a flag given twice counts)."""
        self.logs, self._starts = [], []
        self.processes = []
        bin_dir = str(Path(sys.executable).parent)  # where distributed-mpt-train is installed
        for i, pod in enumerate(pods):
            # The pod's own emptyDirs: TMPDIR (non-chief checkpoints) and HOME.
            tmp, home = scratch / pod.hostname / "tmp", scratch / pod.hostname / "home"
            tmp.mkdir(parents=True, exist_ok=True)
            home.mkdir(parents=True, exist_ok=True)
            env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "TMPDIR": str(tmp), "HOME": str(home),
                   **pod.env}
            if os.environ.get("PYTHONPATH"):  # the package under test, as the image would hold it
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            path = scratch / f"{pod.hostname}.log"
            self._starts.append(path.stat().st_size if path.exists() else 0)  # earlier groups'
            log = open(path, "a")
            self.logs.append(log.name)
            self.processes.append(network.popen(i, [*pod.command, *user_flags(model_dir), *flags], env,
                                                stdout=log, stderr=subprocess.STDOUT))

    def exit_codes(self, timeout: float) -> list:
        """Each pod's exit code as Kubernetes reports it (a signal as 128 + n)."""
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.processes]
        except subprocess.TimeoutExpired:
            pytest.fail(f"pods still running after {timeout} s:\n{self.output()}")
        finally:
            self.kill()
        return [128 - code if code < 0 else code for code in codes]

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def own_output(self) -> str:
        """What this group's pods wrote (not an earlier group's)."""
        return "\n".join(Path(log).read_bytes()[start:].decode(errors="replace")
                         for log, start in zip(self.logs, self._starts))

    def output(self) -> str:
        return "\n".join(f"--- {log}\n{Path(log).read_text()[-3000:]}" for log in self.logs)


class Groups:
    """Starts groups; leaves no process behind when the test ends, however."""

    def __init__(self):
        self._started = []

    def start(self, *args) -> Group:
        self._started.append(Group(*args))
        return self._started[-1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for group in self._started:
            group.kill()


def checkpointed_step(model_dir: Path) -> int:
    """The step of the latest checkpoint in model_dir, 0 if none."""
    state = model_dir / "checkpoints" / "checkpoint"
    match = re.search(r'model_checkpoint_path: "ckpt-(\d+)"', state.read_text()) if state.exists() else None
    return int(match.group(1)) if match else 0


