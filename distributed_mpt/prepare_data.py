"""Download and prepare CIFAR-10 once, for training runs that must not download.

    distributed-mpt-prepare-data --data_dir=/data/tfds

Run it where there is network (or with cifar-10-binary.tar.gz in
<data_dir>/downloads/manual/), then point every trainer at the same
--data_dir with --nodownload.
"""

import sys

from absl import flags

from distributed_mpt.config import user_path
from distributed_mpt.errors import ExitCode, UserError, first_line
from distributed_mpt.process import console, log_filter


def main(argv=None) -> int:
    """Prepares CIFAR-10 in --data_dir; returns the exit code."""
    fv = flags.FlagValues()
    flags.DEFINE_string("data_dir", None, "Where CIFAR-10 is to be: a tensorflow-datasets data "
                        "directory (default ~/tensorflow_datasets), or one that holds the "
                        "official binary release (cifar-10-batches-bin/), which is ready as it is.",
                        flag_values=fv)
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__ + "\nFlags:\n" + fv.get_help())
        return ExitCode.OK
    try:
        fv(["distributed-mpt-prepare-data", *argv])
    except flags.Error as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return ExitCode.USAGE
    data_dir = user_path(fv.data_dir)
    try:
        # TensorFlow's C++ start-up lines, off the console. What training
        # reads: the official binary release, where the directory holds it,
        # is ready as it is.
        with log_filter.filtering():
            from distributed_mpt.training import datasets  # imports TensorFlow
            train, test = datasets.load_dataset("cifar10", data_dir, download=True,
                                                 synthetic_examples=0, seed=0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # tensorflow-datasets downloads into temporary folders
        print("interrupted", file=sys.stderr, flush=True)
        return ExitCode.ABORTED
    source = "the official binary release" if datasets.find_binary_release(data_dir) else \
        "tensorflow-datasets"
    print(f"CIFAR-10 ready in {data_dir or '~/tensorflow_datasets'} ({source}): "
          f"{len(train)} train and {len(test)} test images")
    return ExitCode.OK


def run() -> None:
    """Console-script entry point."""
    sys.exit(console.run_with_console(main))


if __name__ == "__main__":
    run()
