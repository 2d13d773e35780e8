"""Download and prepare CIFAR-10 once, for training runs that must not download.

    distributed-mpt-prepare-data --data_dir=/data/tfds

Run it where there is network (or with cifar-10-binary.tar.gz in
<data_dir>/downloads/manual/), then point every trainer at the same
--data_dir with --nodownload.
"""

import sys

from absl import flags

from distributed_mpt.errors import ExitCode, UserError, first_line
from distributed_mpt.process import console


def main(argv=None) -> int:
    """Prepares CIFAR-10 in --data_dir; returns the exit code."""
    fv = flags.FlagValues()
    flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory.", flag_values=fv)
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__ + "\nFlags:\n" + fv.get_help())
        return ExitCode.OK
    try:
        fv(["distributed-mpt-prepare-data", *argv])
    except flags.Error as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return ExitCode.USAGE
    from distributed_mpt.training import datasets  # imports TensorFlow
    try:
        train, test = datasets.load_cifar10(fv.data_dir, download=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"CIFAR-10 ready in {fv.data_dir or '~/tensorflow_datasets'}: "
          f"{len(train)} train and {len(test)} test images")
    return ExitCode.OK


def run() -> None:
    """Console-script entry point."""
    console.survive_lost_readers()
    sys.exit(main())


if __name__ == "__main__":
    run()
