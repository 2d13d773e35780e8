"""Upstream airbench94 in PyTorch and this package's airbench, side by side on
this CPU: images per second of the training step, same precision, batch and
steps, measured in alternating rounds, and their ratio (docs/performance.md).

    python3 docs/pytorch_side_by_side.py --airbench=CLONE/legacy/airbench94.py \\
        --data_dir=DIR [--precision=float32|bfloat16] [--rounds=3] \\
        [--benchmark="distributed-mpt-benchmark"]

CLONE is your clone of github.com/KellerJordan/cifar10-airbench (airbench94.py
moved to legacy/ there); DIR holds `cifar-10-batches-bin/`, the binary
release this package trains on. Run it with a Python that has PyTorch (not a
dependency of the package); --benchmark is how to start the package's
benchmark (another interpreter's, if need be: "/venv/bin/python -m
distributed_mpt.benchmark"). Each round runs the package's benchmark cell
(`--models=airbench --sections=training`), then upstream's training loop for
the same number of steps, each in a fresh process, both timed as the
benchmark times: 2 warm-up steps, then --repeats calls of the benchmark's
steps, the fastest reported.

Upstream runs as it is written, its own `main()`, with only what a CPU needs:
  - `.cuda()` of tensors and modules does nothing (the CPU is the device), and
    CifarLoader's `gpu=0` default becomes "cpu" (its torch.load map_location);
  - `.half()` of tensors and modules gives float32 (--precision=float32) or
    bfloat16 (--precision=bfloat16) in place of float16: upstream's own
    arrangement (half weights and activations, batch norm in float32) in the
    CPU's precision; the package's cell is `mixed_bfloat16` there (in
    bfloat16, upstream's lookahead, which averages only float16 and float32
    tensors, leaves the weights alone: a little less work than on a GPU);
  - torch.cuda.Event and torch.cuda.synchronize time with the CPU's clock;
  - hyp['opt']['batch_size'] is --batch_size (upstream: 1024), and
    torch.set_num_threads(the cores this process may use), as TensorFlow uses;
  - train.pt and test.pt are made from the binary release in a temporary
    directory (what upstream's CifarLoader saves from torchvision's CIFAR10);
  - where torchvision does not import (PyPI's torchvision beside the CPU build
    of torch from its wheel fails: "operator torchvision::nms does not
    exist"), upstream gets a stand-in whose transforms.Normalize is
    torchvision's arithmetic, (x - mean) / std per channel: upstream uses
    nothing else of it once the tensors are made, and none of it in a step.
Its loop is timed from inside its train loader: each batch it hands out ends
the step before; after the steps measured, the next one raises, which ends
`main()`. A step is upstream's forward, loss, backward, SGD, scheduler and,
every 5th, its lookahead; its per-epoch augmentation (a flip and crop of the
whole split, before an epoch's first batch) is timed apart and not in the
rate. The package's cell trains without lookahead on synthetic data, with its
augmentation in the input pipeline, running beside the step.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

WARMUP_STEPS = 2  # as the package's benchmark (benchmark/cells.py)
PACKAGE_PRECISION = {"float32": "float32", "bfloat16": "mixed_bfloat16"}
_RECORD = 1 + 32 * 32 * 3  # a label byte, then the image's channels, each 32x32


def parse(argv):
    """The command line, checked; exits 2 with one `error:` line otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--airbench", required=True, help="Upstream's airbench94.py.")
    parser.add_argument("--data_dir", required=True, help="Holds cifar-10-batches-bin/.")
    parser.add_argument("--precision", choices=sorted(PACKAGE_PRECISION), default="float32")
    parser.add_argument("--batch_size", type=int, default=512, help="Global batch (512).")
    parser.add_argument("--rounds", type=int, default=3, help="Alternating rounds (3).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed calls per measurement, "
                        "the fastest reported (3, the benchmark's default).")
    parser.add_argument("--benchmark", default="distributed-mpt-benchmark",
                        help="The command that starts the package's benchmark.")
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)  # a round's own child
    parser.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(2))
    args = parser.parse_args(argv)
    if not os.path.isfile(args.airbench):
        parser.error(f"--airbench={args.airbench} is not a file: give your clone's "
                     f"legacy/airbench94.py")
    if not os.path.isdir(os.path.join(args.data_dir, "cifar-10-batches-bin")):
        parser.error(f"--data_dir={args.data_dir} holds no cifar-10-batches-bin/")
    for name in ("batch_size", "rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if torch_version() is None:  # found now, not after the first round of the package's
        parser.error(f"PyTorch is not installed in this Python ({sys.executable}): run the "
                     f"script with one that has it")
    return args


def torch_version():
    """The installed PyTorch's version (None if there is none), without
    importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """This machine's CPU, as /proc/cpuinfo names it: the figures are its."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def save_airbench_tensors(data_dir: str, into: str) -> None:
    """cifar10/train.pt and test.pt in `into`, as upstream's CifarLoader saves
    them: uint8 images [N, 32, 32, 3], int64 labels, the class names."""
    import numpy as np
    import torch

    source = os.path.join(data_dir, "cifar-10-batches-bin")
    with open(os.path.join(source, "batches.meta.txt")) as f:
        classes = [line.strip() for line in f if line.strip()]
    os.makedirs(os.path.join(into, "cifar10"))
    for name, files in (("train", [f"data_batch_{i}.bin" for i in range(1, 6)]),
                        ("test", ["test_batch.bin"])):
        records = np.concatenate([np.fromfile(os.path.join(source, f), np.uint8)
                                  .reshape(-1, _RECORD) for f in files])
        images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        torch.save({"images": torch.tensor(np.ascontiguousarray(images)),
                    "labels": torch.tensor(records[:, 0].astype(np.int64)), "classes": classes},
                   os.path.join(into, "cifar10", f"{name}.pt"))


def _torchvision_or_stand_in() -> None:
    """torchvision, or where it does not import, a stand-in in sys.modules
    with the one thing upstream uses of it (the module's docstring)."""
    try:
        import torchvision  # noqa: F401
        import torchvision.transforms  # noqa: F401
        return
    except (ImportError, RuntimeError) as e:
        print(f"torchvision does not import ({str(e).splitlines()[-1]}): upstream gets a "
              f"stand-in for transforms.Normalize", file=sys.stderr, flush=True)
    import types

    import torch

    class Normalize(torch.nn.Module):
        def __init__(self, mean, std):
            super().__init__()
            self.mean, self.std = torch.as_tensor(mean), torch.as_tensor(std)

        def forward(self, images):  # [..., C, H, W]
            return (images - self.mean.to(images.dtype).view(-1, 1, 1)) \
                / self.std.to(images.dtype).view(-1, 1, 1)

    for name in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[name]  # what a failed import left behind
    torchvision = types.ModuleType("torchvision")
    torchvision.transforms = types.ModuleType("torchvision.transforms")
    torchvision.transforms.Normalize = Normalize
    sys.modules.update({"torchvision": torchvision,
                        "torchvision.transforms": torchvision.transforms})


class _CpuEvent:
    """torch.cuda.Event's timing, with the CPU's clock."""

    def __init__(self, **_):
        self.at = None

    def record(self, *_):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return 1e3 * (end.at - self.at)  # milliseconds, as CUDA's


class _Measured(Exception):
    """Raised by the train loader once the steps measured are done."""


def measure_upstream(args) -> dict:
    """Runs upstream's main() on this CPU (the changes: the module's
    docstring) and times `args.repeats` runs of `args.steps` steps after
    WARMUP_STEPS; returns the fastest images/s and the rest."""
    import torch
    from torch import nn

    cast = {"float32": torch.Tensor.float, "bfloat16": torch.Tensor.bfloat16}[args.precision]
    module_cast = {"float32": nn.Module.float, "bfloat16": nn.Module.bfloat16}[args.precision]
    torch.Tensor.cuda = lambda self, *a, **k: self
    nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.half, nn.Module.half = cast, module_cast
    torch.cuda.Event, torch.cuda.synchronize = _CpuEvent, lambda *a, **k: None
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    _torchvision_or_stand_in()

    spec = importlib.util.spec_from_file_location("airbench94", os.path.abspath(args.airbench))
    airbench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(airbench)
    loader = airbench.CifarLoader
    code, defaults = loader.__init__.__code__, loader.__init__.__defaults__
    arguments = code.co_varnames[:code.co_argcount]
    loader.__init__.__defaults__ = tuple("cpu" if name == "gpu" else value for name, value
                                         in zip(arguments[-len(defaults):], defaults))
    airbench.hyp["opt"]["batch_size"] = args.batch_size

    batches = WARMUP_STEPS + args.repeats * args.steps + 1  # the last one ends the last step
    ends, prologue = [], []
    upstream_iter = loader.__iter__

    def timed_iter(self):
        started = time.perf_counter()
        for number, batch in enumerate(upstream_iter(self)):
            if not self.aug:  # the test loader
                yield batch
                continue
            ends.append(time.perf_counter())
            if number == 0:
                prologue.append(ends[-1] - started)
            if len(ends) == batches:
                raise _Measured
            yield batch
        if self.aug:
            raise RuntimeError(f"an epoch of {len(self)} steps is shorter than the "
                               f"{batches - 1} measured: lower --repeats")

    loader.__iter__ = timed_iter
    with tempfile.TemporaryDirectory() as work:
        save_airbench_tensors(args.data_dir, work)
        os.chdir(work)  # upstream reads cifar10/ from the working directory
        try:
            airbench.main(0)
        except _Measured:
            pass
    timed = [ends[WARMUP_STEPS + i * args.steps:WARMUP_STEPS + (i + 1) * args.steps + 1]
             for i in range(args.repeats)]
    rates = [args.steps * args.batch_size / (call[-1] - call[0]) for call in timed]
    return {"examples_per_second": max(rates), "runs": rates, "steps": args.steps,
            "epoch_augmentation_seconds": prologue[0], "torch": torch.__version__,
            "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure_package(args) -> dict:
    """The package benchmark's airbench cell, at the same precision and batch."""
    with tempfile.TemporaryDirectory() as work:
        output = os.path.join(work, "bench.json")
        command = [*shlex.split(args.benchmark), "--models=airbench", "--sections=training",
                   f"--batch_sizes={args.batch_size}", f"--repeats={args.repeats}",
                   f"--precisions={PACKAGE_PRECISION[args.precision]}", f"--output={output}"]
        try:  # its progress goes to stderr, where the user sees it
            finished = subprocess.run(command, stdout=subprocess.DEVNULL)
        except OSError as e:
            raise Failed(f"cannot start the package's benchmark ({e.strerror}): give "
                         f"--benchmark=\"PYTHON -m distributed_mpt.benchmark\"") from None
        if finished.returncode:
            raise Failed(f"the package's benchmark exited {finished.returncode}: {command}")
        with open(output) as f:
            return json.load(f)["sections"]["training"]["rows"][0]


def measure_upstream_in_a_process(args, argv, steps: int) -> dict:
    """measure_upstream in a fresh process, as the benchmark measures."""
    child = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f"--steps={steps}"],
                           capture_output=True, text=True)
    if child.returncode:
        lines = child.stderr.strip().splitlines() or ["?"]
        raise Failed(f"upstream's run exited {child.returncode}: {lines[-1]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


class Failed(Exception):
    """A measurement that failed: one line saying which, and why."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.steps:  # a round's upstream measurement, in its own process
        print(json.dumps(measure_upstream(args)), flush=True)
        return 0
    machine = f"{len(os.sched_getaffinity(0))} cores of an {cpu_model()}"
    print(f"airbench at batch {args.batch_size}, {args.precision}, {args.rounds} rounds; "
          f"PyTorch {torch_version()}; {machine}; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    ratios = []
    for round_number in range(1, args.rounds + 1):
        try:
            ours = measure_package(args)
            theirs = measure_upstream_in_a_process(args, argv, ours["steps"])
        except Failed as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        ratios.append(ours["examples_per_second"] / theirs["examples_per_second"])
        print(f"round {round_number}: package {ours['examples_per_second']:.1f} images/s "
              f"(peak {ours['peak_memory_bytes'] / 1e9:.1f} GB), PyTorch {theirs['torch']} "
              f"{theirs['examples_per_second']:.1f} images/s (peak "
              f"{theirs['peak_memory_bytes'] / 1e9:.1f} GB; its per-epoch augmentation "
              f"{theirs['epoch_augmentation_seconds']:.1f} s), {ours['steps']} steps x "
              f"{args.repeats}: ratio {ratios[-1]:.2f}x; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"package / PyTorch {torch_version()} images/s: median {statistics.median(ratios):.2f}x, "
          f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds, on {machine}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
