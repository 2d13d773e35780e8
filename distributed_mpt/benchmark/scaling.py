"""Past one machine, projected: step time, throughput and scaling efficiency
of the package's data-parallel training on 1-64 nodes x 1-8 devices at 25,
100 and 400 Gb/s, for airbench, ResNet-9 or a model given by its parameter
count. docs/scaling.md says where every figure comes from.

The model of a step: compute (published GPU step times, or this CPU's,
measured) plus what MultiWorkerMirroredStrategy sends, each collective
costing a latency plus its bytes over a bandwidth (the alpha-beta model):
the gradients (one pack, after the backward pass: what the package does
today), five all-reduces of a few floats per synchronized batch norm and the
stop agreement. Variants: a collective per gradient tensor (no packing), and
packs of PACK_BYTES that overlap the backward pass (a what-if: the package's
loop does not overlap today). NCCL's constants are stated assumptions; the
gRPC ring's are fitted on the package's own all-reduce (allreduce.py).

    python -m distributed_mpt.benchmark.scaling  # A100, NCCL
    python -m distributed_mpt.benchmark.scaling --device=H100 --svg=scaling.svg
    python -m distributed_mpt.benchmark.scaling --params=25557032 --step_ms=103.6 --batch=256
    python -m distributed_mpt.benchmark.scaling --measure  # fit the ring here first (minutes)
"""

import dataclasses
import math
import os
import sys
from typing import Dict, List, Optional, Tuple

from absl import flags

from distributed_mpt import cli, files
from distributed_mpt.benchmark.allreduce import packs
from distributed_mpt.core.optim.schedules import linear_rule_warning, scaled_learning_rate
from distributed_mpt.errors import ConfigError, ExitCode, first_line
from distributed_mpt.process import stopping
from distributed_mpt.recipes import CIFAR10_TRAIN_EXAMPLES

NODES = (1, 2, 4, 8, 16, 32, 64)
DEVICES_PER_NODE = (1, 2, 4, 8)
LINKS_GBPS = (25, 100, 400)
PACK_BYTES = 4 * 2**20  # the packed variant's bytes_per_pack; measured here (docs/scaling.md)
# The share of a step's compute that is the backward pass, which the packed
# variant's all-reduce can hide behind (forward 1, backward 2: roof.py's 3x).
BACKWARD_SHARE = 2 / 3

# NCCL, which cannot run here. Assumptions, not measurements: a collective's
# latency within a node and per tree level across nodes (NCCL's double binary
# trees: log2 of the nodes, twice), and the share of a link's rate that its
# bus bandwidth reaches (nccl-tests' busbw, doc/PERFORMANCE.md).
NCCL_LATENCY_NODE = 10e-6
NCCL_LATENCY_HOP = 5e-6
LINK_EFFICIENCY = 0.9
VARIANTS = ("tensor", "pack", "overlap")


@dataclasses.dataclass(frozen=True)
class Device:
    """A device's compute, against the A100's (`speed`), and its links
    within a node (per direction, bytes/s): each with its source."""

    speed: float
    nvlink_bytes_per_second: float
    source: str


# NVIDIA's datasheets: dense FP16/BF16 tensor throughput (A100 312 TFLOP/s,
# H100 and H200 SXM 989) and NVLink (600 and 900 GB/s both ways, so 300 and
# 450 each way, of which LINK_EFFICIENCY is assumed reached). The speed ratio
# is an upper bound for networks as small as CIFAR-10's, so the projected
# efficiency on H100 and H200 is a lower bound.
DEVICES = {
    "A100": Device(1.0, 300e9 * LINK_EFFICIENCY, "A100 step times as published (below)"),
    "H100": Device(989 / 312, 450e9 * LINK_EFFICIENCY,
                   "A100 step / 3.17 (datasheet FP16 ratio: an upper bound on the speed-up)"),
    "H200": Device(989 / 312, 450e9 * LINK_EFFICIENCY,
                   "as H100 (the same compute; more memory bandwidth, which the ratio ignores)"),
    "cpu": Device(0.0, 0.0, "the development machine's CPU (docs/scaling.md); gRPC ring only"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model as the projection sees it: its batch per device, its step on
    one device (seconds, and where that figure comes from), its gradient
    tensors' bytes (None: only the total is known), the small all-reduces of
    a step, and its learning rate at the reference batch and its ceiling."""

    name: str
    batch: int
    step: float
    step_source: str
    gradient_bytes: int
    tensor_bytes: Optional[Tuple[int, ...]]
    small_collectives: int
    learning_rate: float
    max_learning_rate: float = 0.0


# One device's step, as published. airbench94.py: 3.83 s for 9.9 epochs of
# 48 batches of 1024 (476 steps) on an A100 (Jordan 2024). ResNet-9: 79 s for
# 24 epochs of 98 batches of 512 on a V100 (Page 2018), times 1200/2470,
# NVIDIA's V100/A100 ratio of ResNet-50 v1.5 training throughput with AMP.
A100_STEPS = {
    "airbench": (3.83 / 476, "3.83 s / 476 steps of airbench94.py on an A100, from Jordan 2024, "
                 "arXiv:2404.00498"),
    "resnet9": (79 / (24 * 98) * 1200 / 2470, "79 s / 2352 steps on a V100, from Page 2018 (myrtle.ai), "
                "x 1200/2470, from NVIDIA DeepLearningExamples' ResNet-50 AMP throughput")}
BATCHES = {"airbench": 1024, "resnet9": 512}
# The development machine's step at the same batches in float32, measured
# there with the benchmark while 7 other jobs shared its 2 cores (AMD EPYC
# Zen 1, AVX2; docs/scaling.md): the best of 3 calls.
CPU_STEPS = {name: (BATCHES[name] / rate,
                    f"{rate} ex/s measured on a shared 2-core AMD EPYC (Zen 1)")
             for name, rate in (("airbench", 34.6), ("resnet9", 16.0))}

# The gRPC ring (--communication=ring), fitted on the loopback sweep of
# docs/scaling.md (allreduce.fit): latency per ring step, seconds per byte.
RING = (2.71e-3, 1 / 138e6)


# Each model's trainable variables in bytes (float32 gradients), in the
# order Keras lists them, and its batch norms, counted from the models the
# package builds at width 64 (tests/benchmark/test_scaling.py keeps them equal), so
# that a projection needs no TensorFlow.
GRADIENT_TENSORS = {
    "airbench": (96, 55296, 256, 147456, 256, 589824, 1024, 2359296, 1024, 2359296, 1024, 2359296,
                 1024, 10240),
    "resnet9": (6912, 256, 256, 294912, 512, 512, 589824, 512, 512, 589824, 512, 512, 1179648, 1024,
                1024, 4718592, 2048, 2048, 9437184, 2048, 2048, 9437184, 2048, 2048, 20480)}
BATCH_NORMS = {"airbench": 6, "resnet9": 8}


def workload(name: str, device: str) -> Workload:
    """airbench or resnet9 (width 64) on `device`, with its defaults' rate."""
    from distributed_mpt.core import models

    step, source = CPU_STEPS[name] if device == "cpu" else A100_STEPS[name]
    if device not in ("cpu", "A100"):
        step, source = step / DEVICES[device].speed, f"{source}; {DEVICES[device].source}"
    defaults = models.model_spec(name).defaults
    sizes = GRADIENT_TENSORS[name]
    # Reversed: TensorFlow all-reduces the gradients last layer first.
    return Workload(name, BATCHES[name], step, source, sum(sizes), tuple(reversed(sizes)),
                    small_collectives(BATCH_NORMS[name]), defaults.learning_rate,
                    defaults.max_learning_rate)


def small_collectives(batch_norms: int) -> int:
    """The all-reduces of a few floats in each step: Keras' synchronized
    batch norm sums three statistics apart and two of them back in the
    backward pass; the training loop agrees on stopping once a step."""
    return 5 * batch_norms + 1


@dataclasses.dataclass(frozen=True)
class Link:
    """What a collective costs among `ranks`: a latency and seconds per byte
    of bus traffic (the bytes times 2(n-1)/n, nccl-tests' busbw)."""

    latency: float
    seconds_per_byte: float
    ranks: int

    def all_reduce(self, size: float, collectives: int = 1) -> float:
        """Seconds for `collectives` all-reduces carrying `size` bytes in all."""
        if self.ranks == 1:
            return 0.0
        return collectives * self.latency + 2 * (self.ranks - 1) / self.ranks * size * self.seconds_per_byte


def link(communication: str, device: Device, nodes: int, per_node: int, gbps: float,
         ring=RING) -> Link:
    """The cost of one all-reduce over `nodes` x `per_node` ranks; `ring`:
    the gRPC ring's latency per step and seconds per byte (a fit's)."""
    ranks = nodes * per_node
    network = 8 / (gbps * 1e9 * LINK_EFFICIENCY)
    if communication == "ring":  # 2(n-1) steps in turn; a byte as slow as gRPC or the link
        return Link(2 * (ranks - 1) * ring[0], max(ring[1], network), ranks)
    per_byte = 1 / device.nvlink_bytes_per_second if nodes == 1 else network
    latency = NCCL_LATENCY_NODE + 2 * math.ceil(math.log2(nodes)) * NCCL_LATENCY_HOP
    return Link(latency, per_byte, ranks)


def step_seconds(work: Workload, cost: Link, variant: str) -> Optional[float]:
    """A step's seconds: compute, the small all-reduces, and the gradients'
    all-reduce sent as `variant`: "tensor" (one collective per tensor),
    "pack" (one, after the backward pass: what the package does) or
    "overlap" (packs of PACK_BYTES hidden behind the backward pass, all but
    the last: a what-if). None where the tensors are not known."""
    small = cost.all_reduce(12 * work.small_collectives, work.small_collectives)  # 3 floats each
    size = work.gradient_bytes
    if variant == "tensor":
        if work.tensor_bytes is None:
            return None
        gradients = cost.all_reduce(size, len(work.tensor_bytes))
    elif variant == "pack":
        gradients = cost.all_reduce(size)
    else:
        count = packs(work.tensor_bytes or (size,), PACK_BYTES)
        gradients = max(cost.all_reduce(min(PACK_BYTES, size)),
                        cost.all_reduce(size, count) - BACKWARD_SHARE * work.step)
    return work.step + small + gradients


def projection(work: Workload, device: str, communication: str, ring=RING) -> List[dict]:
    """A row per nodes x devices per node: the global batch, the peak
    learning rate the package derives for it and what the batch rule says
    (`batch_rule`), and per link and variant the step time, examples/s and
    efficiency over one device."""
    rows = []
    for n in NODES:
        for g in (DEVICES_PER_NODE if device != "cpu" else (1,)):
            batch = n * g * work.batch
            row = {"nodes": n, "devices": g, "global_batch": batch, "rule": batch_rule(batch),
                   "learning_rate": scaled_learning_rate(work.learning_rate, batch,
                                                         work.max_learning_rate)}
            for gbps in LINKS_GBPS:
                cost = link(communication, DEVICES[device], n, g, gbps, ring)
                for variant in VARIANTS:
                    seconds = step_seconds(work, cost, variant)
                    row[f"{gbps}/{variant}"] = None if seconds is None else {
                        "step_seconds": seconds, "examples_per_second": batch / seconds,
                        "efficiency": work.step / seconds}
            rows.append(row)
    return rows


def batch_rule(global_batch: int) -> str:
    """What the package does with `global_batch` on CIFAR-10: trains it
    ("ok"), warns that the linear rule is known to fail there ("warns"), or
    refuses it, larger than the training split ("refused")."""
    if global_batch > CIFAR10_TRAIN_EXAMPLES:
        return "refused"
    return "warns" if linear_rule_warning(global_batch, CIFAR10_TRAIN_EXAMPLES) else "ok"


def format_table(work: Workload, device: str, communication: str, rows: List[dict]) -> str:
    """The projection of one model, a line per nodes x devices."""
    tensors = len(work.tensor_bytes) if work.tensor_bytes else "?"
    step = f"{work.step:.3g} s" if work.step >= 1 else f"{work.step * 1e3:.3g} ms"
    lines = [f"{work.name} on {device}, {communication}: batch {work.batch} a device, "
             f"{work.gradient_bytes / 2**20:.1f} MiB of gradients in {tensors} tensors, "
             f"{work.small_collectives} small all-reduces a step; one device's step {step} "
             f"({work.step_source})",
             "  ms and ex/s: a step with the gradients in one pack (what the package does); "
             "eff t/p/o: efficiency over one device with a collective per tensor / one pack / "
             "packs overlapping the backward pass (a what-if); rule: on CIFAR-10",
             "  nodes x dev  global batch  peak lr  rule   " +
             " | ".join(f"{g:>3} Gb/s: ms    ex/s  eff t/p/o" for g in LINKS_GBPS)]
    for row in rows:
        cells = []
        for gbps in LINKS_GBPS:
            pack = row[f"{gbps}/pack"]
            effs = " ".join(" -  " if row[f"{gbps}/{v}"] is None else
                            f"{row[f'{gbps}/{v}']['efficiency']:.2f}" for v in VARIANTS)
            cells.append(f"{pack['step_seconds'] * 1e3:>12.1f} {_count(pack['examples_per_second']):>7} "
                         f"{effs}")
        lines.append(f"  {row['nodes']:>5} x {row['devices']:<3} {row['global_batch']:>12,}  "
                     f"{row['learning_rate']:>7.3g}  {row['rule']:<7}" + " | ".join(cells))
    return "\n".join(lines)


def _count(value: float) -> str:
    return (f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k" if value >= 1e3
            else f"{value:.0f}")


def svg(projections: Dict[str, List[dict]], title: str) -> str:
    """The efficiency against devices in all (log scale; past the first
    node, the most devices a node has), a colour per model, lighter for
    slower links; solid: one pack (today), dashed: packs overlapping the
    backward pass."""
    width, height, left, bottom, right = 760, 420, 60, 40, 200
    x = lambda devices: left + math.log2(devices) / 9 * (width - left - right)  # noqa: E731
    y = lambda eff: height - bottom - eff * (height - bottom - 40)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">', f'<text x="{left}" y="18">{title}</text>',
             f'<text x="{left + 120}" y="{height - 6}">devices in all (log scale); y: scaling '
             f'efficiency</text>']
    parts += [f'<line x1="{left}" x2="{x(512)}" y1="{y(e)}" y2="{y(e)}" stroke="#ddd"/>'
              f'<text x="{left - 32}" y="{y(e) + 4}">{e:.2f}</text>' for e in (0, 0.25, 0.5, 0.75, 1)]
    parts += [f'<text x="{x(d) - 8}" y="{height - bottom + 16}">{d}</text>' for d in (1, 8, 64, 512)]
    legend = 40
    for colour, (name, rows) in zip(("#1f77b4", "#d62728", "#2ca02c", "#9467bd"), projections.items()):
        most = max(r["devices"] for r in rows)  # a node's devices past the first node (1 for CPUs)
        points = [r for r in rows if r["nodes"] == 1 or r["devices"] == most]
        for gbps, opacity in zip(LINKS_GBPS, (0.4, 0.7, 1.0)):
            for variant, dash in (("pack", ""), ("overlap", ' stroke-dasharray="5,4"')):
                path = " ".join(f"{x(r['nodes'] * r['devices']):.1f},"
                                f"{y(r[f'{gbps}/{variant}']['efficiency']):.1f}" for r in points)
                parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                             f'stroke-opacity="{opacity}" stroke-width="1.6"{dash}/>')
            parts.append(f'<text x="{width - right + 15}" y="{legend}" fill="{colour}" '
                         f'fill-opacity="{opacity}">{name}, {gbps} Gb/s</text>')
            legend += 15
    parts.append(f'<text x="{width - right + 15}" y="{legend + 10}">solid: one pack (today)</text>'
                 f'<text x="{width - right + 15}" y="{legend + 25}">dashed: packs, overlapped</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_enum("device", "A100", list(DEVICES), "Whose compute and links within a node.",
                      flag_values=fv)
    flags.DEFINE_enum("communication", "nccl", ["nccl", "ring"], "nccl (GPUs; stated "
                      "assumptions) or ring (TensorFlow's over gRPC, fitted here).", flag_values=fv)
    flags.DEFINE_list("models", list(A100_STEPS), "Of airbench, resnet9 (none: only yours).",
                      flag_values=fv)
    # Bounded past any model: a number past them would overflow the tables'
    # floats, and `inf` or `nan` make tables of nan.
    cli.define_float(fv, "params", None, "Also project a model of this many parameters (float32 "
                     "gradients), with --step_ms and --batch.", lower=1, upper=1e15)
    cli.define_float(fv, "step_ms", None, "Its step on one --device, in ms.", lower=1e-3,
                     upper=1e9)
    cli.define_integer(fv, "batch", None, "Its batch per device.", lower=1, upper=10**9)
    cli.define_integer(fv, "batch_norms", 0, "Its synchronized batch norms.", lower=0,
                       upper=10**6)
    cli.define_float(fv, "learning_rate", 0.1, "Its rate at batch 128.", lower=0, upper=100)
    flags.DEFINE_string("svg", None, "Also draw the efficiency into this SVG file.", flag_values=fv)
    flags.DEFINE_bool("measure", False, "First time the ring here (2 and 3 local workers, a few "
                      "minutes), fit it, and project the ring with that fit.", flag_values=fv)
    return fv


def workloads(fv: flags.FlagValues) -> List[Workload]:
    """The models to project: the built-in ones named, and the user's."""
    bad = [m for m in fv.models if m not in A100_STEPS]
    if bad:
        raise ConfigError(f"--models: {', '.join(bad)}: choose from {', '.join(A100_STEPS)}")
    given = [fv[name].value is not None for name in ("params", "step_ms", "batch")]
    if any(given) and not all(given):
        raise ConfigError("a model of your own needs all of --params, --step_ms and --batch")
    if not fv.models and not any(given):
        raise ConfigError("nothing to project: name --models, or give --params, --step_ms and --batch")
    chosen = [workload(m, fv.device) for m in fv.models]
    if all(given):
        chosen.append(Workload(f"{fv.params:,.0f} parameters", fv.batch, fv.step_ms / 1000,
                               "given (--step_ms)", int(fv.params) * 4, None,
                               small_collectives(fv.batch_norms), fv.learning_rate))
    return chosen


def main(argv=None) -> int:
    """Prints the projection the flags ask for; returns the exit status."""
    # The plot is written last, whole: a stop before it leaves nothing.
    return cli.run_main(__doc__, _flag_values(), _project, argv, on_interrupt="nothing written")


def _project(fv: flags.FlagValues, argv: List[str]) -> int:
    """Parses `argv` into `fv`, prints the tables (and writes the plot)."""
    cli.parse("distributed-mpt-scaling", fv, argv)
    cli.check_path_flags(fv, "svg")
    if fv.svg:  # now, not after the models are built
        files.check_replaceable(fv.svg, f"--svg={fv.svg}")
        files.check_writable(os.path.dirname(os.path.abspath(fv.svg)), "--svg")
    if fv.device == "cpu" and fv.communication != "ring":
        raise ConfigError("--device=cpu: CPUs all-reduce over gRPC; add --communication=ring")
    chosen = workloads(fv)  # refused now, not after minutes of --measure
    ring = RING
    if fv.measure:
        from distributed_mpt.benchmark.allreduce import measure_and_fit
        try:  # SIGTERM too ends the workers timing the ring (stops_interrupting)
            with stopping.stops_interrupting():
                *ring, report = measure_and_fit()
        except RuntimeError as e:  # a worker failed: run_cell's line says which and why
            print(f"error: --measure: the ring could not be timed here: {first_line(e)}",
                  file=sys.stderr, flush=True)
            return ExitCode.CRASHED
        print(report, flush=True)
    projections = {w.name: projection(w, fv.device, fv.communication, tuple(ring)) for w in chosen}
    print("\n\n".join(format_table(w, fv.device, fv.communication, projections[w.name])
                      for w in chosen), flush=True)
    if fv.svg:
        files.write_text(fv.svg, svg(projections, f"Projected scaling efficiency: {fv.device}, "
                                                  f"{fv.communication} (docs/scaling.md)"))
        print(f"wrote {fv.svg}", flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    cli.console_script(main)
