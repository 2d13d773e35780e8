"""A slow, lossy link between two network namespaces, in userspace: what
`tc qdisc add ... netem delay D loss L` does, for kernels without sch_netem.

A TUN device in each namespace, and this process carrying the IP packets
that either side sends (IPv4 or IPv6, whole: one read is one packet) to
the other, each held for a set delay and a set fraction of them dropped,
in each direction independently. On command it stalls: it holds every
packet, in both directions, for a while, then delivers what it held (a
link that goes silent and recovers, as a switch rebooting or a congested
uplink does).

    python tests/support/lossy_link.py NETNS_A NETNS_B --delay_ms=200 --loss=0.05

creates a device named `lossy0` in each of the namespaces /run/netns/NETNS_A
and /run/netns/NETNS_B, prints `ready`, then reads commands on stdin, one a
line, and answers each with one line on stdout:

    stall SECONDS   hold every packet for SECONDS from now  -> ok
    stats           -> {"a_to_b": {"read": n, "dropped": n, ...}, "b_to_a": {...}}

(read = dropped + overflowed + delivered + undeliverable + still queued).

At the end of its stdin (its parent closed it, or died) it prints the
statistics and exits; the devices go with it. Setting the devices up and
routing through them is the caller's part (tests/support/netns.py).
Needs root (CAP_NET_ADMIN) and /dev/net/tun.
"""

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import select
import struct
import sys
import time

DEVICE = "lossy0"
TUNSETIFF = 0x400454CA  # _IOW('T', 202, int), linux/if_tun.h
IFF_TUN = 0x0001        # IP packets, no Ethernet header: no ARP on a point-to-point link
IFF_NO_PI = 0x1000      # no 4-byte header: the kernel tells IPv4 from IPv6 by the version nibble
CLONE_NEWNET = 0x40000000
# Larger than any MTU a TUN device takes, so that no read truncates a packet
# whatever MTU the caller sets.
READ_SIZE = 65536
# Packets held per direction before the link drops new ones (netem's
# default limit); a 5 s stall of a training job holds a few hundred.
DEFAULT_LIMIT = 1000


def open_tun(netns: str, name: str = DEVICE) -> int:
    """A TUN device `name` in network namespace `netns` (a name under
    /run/netns), as a non-blocking file descriptor. The device exists
    while the descriptor is open."""
    # The device is made in the network namespace of the thread that opens
    # /dev/net/tun, so enter the pod's namespace for that, and come back.
    # ctypes because os.setns arrived in Python 3.12.
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}: {os.strerror(ctypes.get_errno())}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:  # never go on in the wrong namespace
                raise OSError(ctypes.get_errno(), "setns back into this process's namespace")
    finally:
        os.close(target)
        os.close(home)
    return fd


class Direction:
    """The packets read from one device that wait to be written to the other."""

    def __init__(self, source: int, sink: int):
        self.source, self.sink = source, sink
        # (due time, packet); one delay for all, so due times only grow and
        # packets leave in the order they came.
        self.queue = collections.deque()
        # held: delivered late because a stall held it past its due time.
        self.counts = collections.Counter(read=0, dropped=0, overflowed=0, delivered=0, undeliverable=0,
                                          held=0)


class LossyLink:
    """Carries packets between two TUN devices; `run()` until stdin ends."""

    def __init__(self, a: int, b: int, delay_ms: float, loss: float, limit: int = DEFAULT_LIMIT):
        self.directions = {"a_to_b": Direction(a, b), "b_to_a": Direction(b, a)}
        self.delay, self.loss, self.limit = delay_ms / 1000, loss, limit
        self.stalled_until = 0.0
        self.random = random.Random()

    def run(self, commands: int = 0) -> None:
        """Forwards until `commands` (a file descriptor) reaches its end,
        answering each command line it reads on stdout."""
        pending = b""
        while True:
            timeout = self._deliver(time.monotonic())
            readable, _, _ = select.select([d.source for d in self.directions.values()] + [commands],
                                           [], [], timeout)
            for direction in self.directions.values():
                if direction.source in readable:
                    self._read(direction)
            if commands in readable:
                chunk = os.read(commands, 4096)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self._answer(line.decode().split())

    def stats(self) -> dict:
        """Each direction's packet counts so far."""
        return {name: dict(d.counts) for name, d in self.directions.items()}

    def _read(self, direction: Direction) -> None:
        # At most a burst at a time, so that a flood one way cannot starve
        # the other way or the delivery of what is due.
        for _ in range(256):
            try:
                packet = os.read(direction.source, READ_SIZE)
            except BlockingIOError:
                return
            # (Any other error, the device or its namespace gone, ends the
            # link rather than spinning on a descriptor that stays readable.)
            # The packet's own time: one taken before the burst would make
            # the packets that came during it early.
            due = time.monotonic() + self.delay
            direction.counts["read"] += 1
            if self.random.random() < self.loss:
                direction.counts["dropped"] += 1
            elif len(direction.queue) >= self.limit:
                direction.counts["overflowed"] += 1
            else:
                direction.queue.append((due, packet))

    def _deliver(self, now: float):
        """Writes what is due; returns the seconds until the next packet is
        due (None: nothing held)."""
        waits = []
        for direction in self.directions.values():
            queue = direction.queue
            while queue and max(queue[0][0], self.stalled_until) <= now:
                due, packet = queue.popleft()
                direction.counts["held"] += due < self.stalled_until
                try:
                    os.write(direction.sink, packet)
                    direction.counts["delivered"] += 1
                except OSError:  # the far device is down: lost, as on a wire
                    direction.counts["undeliverable"] += 1
            if queue:
                waits.append(max(queue[0][0], self.stalled_until) - now)
        return min(waits) if waits else None

    def _answer(self, words: list) -> None:
        if words[:1] == ["stall"] and len(words) == 2:
            self.stalled_until = max(self.stalled_until, time.monotonic() + float(words[1]))
            reply = "ok"
        elif words == ["stats"]:
            reply = json.dumps(self.stats())
        else:
            raise ValueError(f"unknown command {' '.join(words)!r}: stall SECONDS, stats")
        print(reply, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("netns", nargs=2, help="the two network namespaces (names under /run/netns)")
    parser.add_argument("--delay_ms", type=float, default=0.0, help="added to every packet, each way")
    parser.add_argument("--loss", type=float, default=0.0, help="the fraction of packets dropped, each way")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="packets held per direction")
    args = parser.parse_args(argv)
    if not (0 <= args.delay_ms < 3_600_000 and 0 <= args.loss <= 1 and args.limit > 0):
        parser.error("need 0 <= --delay_ms < 1 h, 0 <= --loss <= 1 and --limit > 0")
    a, b = (open_tun(netns) for netns in args.netns)
    link = LossyLink(a, b, args.delay_ms, args.loss, args.limit)
    print("ready", flush=True)
    try:
        link.run()
    finally:
        print(json.dumps(link.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
