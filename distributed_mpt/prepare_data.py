"""Download and prepare CIFAR-10 once, for training runs that must not download.

    distributed-mpt-prepare-data --data_dir=/data/tfds

Run it where there is network (or with cifar-10-binary.tar.gz in
<data_dir>/downloads/manual/), then point every trainer at the same
--data_dir with --nodownload.
"""

import errno

from absl import flags

from distributed_mpt import cli, files
from distributed_mpt.config import user_path
from distributed_mpt.errors import ConfigError, ExitCode, UserError
from distributed_mpt.process import log_filter


def _flag_values() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("data_dir", None, "Where CIFAR-10 is to be: a tensorflow-datasets data "
                        "directory (default ~/tensorflow_datasets), or one that holds the "
                        "official binary release (cifar-10-batches-bin/), which is ready as it is.",
                        flag_values=fv)
    return fv


def main(argv=None) -> int:
    """Prepares CIFAR-10 in --data_dir; returns the exit code."""
    # tensorflow-datasets downloads into temporary folders: a stop leaves none.
    return cli.run_main(__doc__, _flag_values(), _prepare, argv, on_interrupt="nothing prepared")


def _prepare(fv: flags.FlagValues, argv) -> int:
    cli.parse("distributed-mpt-prepare-data", fv, argv)
    cli.check_path_flags(fv, "data_dir")
    data_dir = user_path(fv.data_dir)
    where = data_dir or "~/tensorflow_datasets"
    # TensorFlow's C++ start-up lines, off the console. What training reads:
    # the official binary release, where the directory holds it, is ready as
    # it is.
    with log_filter.filtering():
        from distributed_mpt.core import data  # imports TensorFlow
        from distributed_mpt.core.data import cifar10
        try:
            dataset = data.DataOptions(cifar10.NAME, data_dir).load(seed=0)
        except Exception as e:  # noqa: BLE001 - tensorflow-datasets wraps what the OS said
            # A full disk, or a folder it could not make, was a traceback; the
            # package's own errors say it all.
            in_the_way = isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTDIR)
            why = None if isinstance(e, UserError) else \
                e.strerror if in_the_way else files.why_unwritable(e)
            if why is None:
                raise
            if getattr(e, "filename", None):  # a folder tensorflow-datasets makes, say
                why += f": {e.filename}"
            fix = "move it away" if in_the_way else \
                "free space there" if files.is_disk_full(e) else "make it writable"
            raise ConfigError(f"cannot prepare CIFAR-10 in {where} ({why}), nothing prepared: "
                              f"{fix}, or choose another --data_dir") from None
    source = "the official binary release" if cifar10.find_binary_release(data_dir) else \
        "tensorflow-datasets"
    print(f"CIFAR-10 ready in {where} ({source}): "
          f"{len(dataset.train)} train and {len(dataset.test)} test images")
    return ExitCode.OK


def run() -> None:
    """Console-script entry point."""
    cli.console_script(main, exit_at_once=False)


if __name__ == "__main__":
    run()
