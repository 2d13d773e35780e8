"""How far 2 replicas drift from 1 over a whole run, and why (README, "The
global batch"): the package's own runs of a recipe, side by side.

    python3 docs/replica_drift.py --data_dir=DIR [--recipe=cpu_cnn] \\
        [--seeds=0,1] [--out=drift-runs] [--train_flags="..."]

Run it with the Python the package is installed in: it trains with it, and
reads the checkpoints with its TensorFlow. DIR holds `cifar-10-batches-bin/`. For each seed it trains the recipe on one
replica (`--strategy=default`) and on two (`--strategy=mirrored
--cpu_replicas=2`, half the per-replica batch: the same global batch), and,
for the first seed, one replica again with one intra-op thread instead of
every core (`TF_NUM_INTRAOP_THREADS=1`): the control. The two-replica run
differs from the one-replica run only in how its sums are rounded (the
loss, the gradients and the batch-norm statistics are all-reduced over two
halves of the batch, and batch norm is Keras' where one replica uses the
fused kernel); so does the control, which changes nothing but how
the CPU's threads split each reduction. If the two drift from the one-replica
run alike, the drift is round-off that training amplifies, not a difference
in what the replicas compute.

Every run logs every step (`--log_every_steps=1`); the table gives, per span
of steps, the largest relative difference of the logged loss from the
one-replica run of the same seed, then each run's test accuracy and the
relative distance of its final weights from that run's (and, for scale, of
one seed's from another's). Runs already finished in --out are reused, so
an interrupted measurement goes on where it stopped.
--train_flags are added to every run (a smaller network for a quick look:
"--model_width=8 --epochs=1").
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys

import numpy as np


def _runs(seeds):
    """(name, seed, flags, environment) of every run, the control last."""
    runs = []
    for seed in seeds:
        runs.append((f"one-{seed}", seed, ["--strategy=default"], {}))
        runs.append((f"two-{seed}", seed, ["--strategy=mirrored", "--cpu_replicas=2"], {}))
    runs.append((f"one-1thread-{seeds[0]}", seeds[0], ["--strategy=default"],
                 {"TF_NUM_INTRAOP_THREADS": "1"}))
    return runs


def _global_batch(recipe, train_flags):
    """The one-replica run's batch: --train_flags' if they set one, else the
    recipe's."""
    from distributed_mpt.recipes import records

    try:
        flags = records.recipe_flags(recipe)
    except Exception as e:  # noqa: BLE001 - ConfigError for an unknown name, OSError
        _fail(f"--recipe={recipe}: {e}")
    batch = {**flags, **records.flags_of_text("\n".join(shlex.split(train_flags)))}.get(
        "per_replica_batch_size")
    if not str(batch).isdigit() or int(batch) < 1:
        _fail(f"the batch {batch!r} (--per_replica_batch_size of the recipe or of --train_flags, "
              f"as --per_replica_batch_size=N) is not a positive whole number")
    return int(batch)


def _train(args, name, seed, flags, environment):
    """Trains one run into args.out/name unless it finished before."""
    model_dir = os.path.join(args.out, name)
    if os.path.exists(os.path.join(model_dir, "summary.json")):
        return model_dir
    batch = args.batch // (2 if "--cpu_replicas=2" in flags else 1)
    command = [sys.executable, "-m", "distributed_mpt.train", f"--recipe={args.recipe}",
               "--dataset=cifar10", f"--data_dir={args.data_dir}", f"--seed={seed}",
               *shlex.split(args.train_flags), f"--per_replica_batch_size={batch}",
               "--log_every_steps=1", f"--model_dir={model_dir}", *flags]
    print("+", " ".join(f"{k}={v}" for k, v in environment.items()), shlex.join(command),
          flush=True)
    code = subprocess.run(command, env={**os.environ, **environment},
                          stdout=subprocess.DEVNULL).returncode
    if code != 0:
        _fail(f"the run {name} exited with {code} (its output is above; its model_dir: "
              f"{model_dir})", code=1)
    return model_dir


def _fail(message, code=2):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _losses(model_dir):
    """Each logged step's training loss (the package's reader: a damaged
    line is left out, not fatal)."""
    from distributed_mpt.json_lines import read_jsonl

    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))[0]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def _weights(model_dir):
    """The trained weights of the run's final checkpoint, by name: the
    variables the optimizer trains (its slots and the frozen ones left out)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "/_trainable_variables/" in name and "OPTIMIZER_SLOT" not in name}


def _distance(weights, reference):
    """Relative Euclidean distance of all the weights from the reference's."""
    squared = sum(float(np.sum((weights[n] - reference[n]) ** 2)) for n in reference)
    return (squared / sum(float(np.sum(reference[n] ** 2)) for n in reference)) ** 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--recipe", default="cpu_cnn")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--out", default="drift-runs")
    parser.add_argument("--train_flags", default="")
    parser.error = _fail
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.data_dir, "cifar-10-batches-bin")):
        _fail(f"--data_dir={args.data_dir} holds no cifar-10-batches-bin/ (the binary release)")
    try:
        seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",")))
    except ValueError:
        _fail(f"--seeds={args.seeds}: integers separated by commas, e.g. 0,1")
    args.batch = _global_batch(args.recipe, args.train_flags)
    if args.batch % 2:
        _fail(f"a batch of {args.batch} does not split over two replicas: give an even one")

    dirs = {name: (seed, _train(args, name, seed, flags, env))
            for name, seed, flags, env in _runs(seeds)}
    losses = {name: _losses(d) for name, (_, d) in dirs.items()}
    last = max(losses[f"one-{seeds[0]}"])
    spans = [(1, 1)] + [(2 ** k + 1, min(2 ** (k + 1), last))
                        for k in range(20) if 2 ** k + 1 <= last]
    compared = [n for n in dirs if not n.startswith("one-") or "thread" in n]
    print(f"\n{args.recipe}, global batch {args.batch}, {last} steps: the largest relative "
          "difference of the logged loss from one replica's, per span of steps")
    print("steps".ljust(12) + "".join(n.rjust(16) for n in compared))
    for first, end in spans:
        row = []
        for name in compared:
            reference = losses[f"one-{dirs[name][0]}"]
            row.append(max((abs(losses[name][s] - reference[s]) / abs(reference[s])
                            for s in range(first, end + 1)
                            if s in losses[name] and reference.get(s)), default=math.nan))
        print(f"{first}-{end}".ljust(12) + "".join(f"{v:16.1e}" for v in row))

    print("\nrun".ljust(22) + "test accuracy".rjust(14) + "weights' distance".rjust(20))
    for name, (seed, model_dir) in dirs.items():
        with open(os.path.join(model_dir, "summary.json")) as f:
            accuracy = json.load(f)["eval_accuracy"]
        distance = _distance(_weights(model_dir), _weights(dirs[f"one-{seed}"][1]))
        print(name.ljust(21) + f"{accuracy:14.4f}" + f"{distance:20.2e}")
    if len(seeds) > 1:  # another initialization and data order: as far as runs can be
        first, second = (_weights(dirs[f"one-{seed}"][1]) for seed in seeds[:2])
        other = _distance(second, first)
        print(f"one-{seeds[1]} against one-{seeds[0]}".ljust(35) + f"{other:20.2e}")


if __name__ == "__main__":
    main()
