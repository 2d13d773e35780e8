"""CIFAR-10: its classes and statistics, read from the official binary
release or from tensorflow-datasets, with a diagnosis of damaged or missing
files that says how to get them back."""

import contextlib
import hashlib
import logging
import os
import re
import socket
import sys
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

from distributed_mpt import files
from distributed_mpt.core.data.dataset import (SPLITS, Dataset, DatasetInfo, ImageSplit,
                                               aligned_empty)
from distributed_mpt.errors import DataUnavailableError, first_line

NAME = "cifar10"  # tensorflow-datasets' name, and --dataset's
# Its classes in label order (tensorflow-datasets' and Krizhevsky's), and
# the per-channel statistics of its train split on the 0..255 scale.
INFO = DatasetInfo(
    image_shape=(32, 32, 3),
    class_names=("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck"),
    mean=(125.31, 122.95, 113.87),
    std=(62.99, 62.09, 66.70))

CIFAR10_ARCHIVE = "cifar-10-binary.tar.gz"  # what tensorflow-datasets downloads
# The extracted official binary release: five train batches and a test batch
# of 10,000 records, each a label byte and the R, G and B planes (32x32 bytes).
CIFAR10_BINARY_DIR = "cifar-10-batches-bin"
_BINARY_FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
                 "test": ("test_batch.bin",)}
_BINARY_RECORD_BYTES = 1 + 32 * 32 * 3
_BINARY_FILE_BYTES = 10_000 * _BINARY_RECORD_BYTES  # 30,730,000
_CIFAR10_HOST = ("www.cs.toronto.edu", 443)
# tensorflow-datasets retries an unreachable host for minutes; a plain TCP
# connect answers the question "is there network?" in seconds.
_NETWORK_PROBE_SECONDS = 15


def find_binary_release(data_dir: Optional[str]) -> Optional[str]:
    """The official binary release's directory in `data_dir` (the directory
    itself or its `cifar-10-batches-bin/`), or None if it holds none."""
    if not data_dir:
        return None
    if os.path.isdir(os.path.join(data_dir, CIFAR10_BINARY_DIR)):
        return os.path.join(data_dir, CIFAR10_BINARY_DIR)
    if any(os.path.exists(os.path.join(data_dir, name))
           for names in _BINARY_FILES.values() for name in names):
        return data_dir
    return None


# Records of each binary file compared with the others' (a copy's are the same).
_COMPARED_RECORDS = 100


def load_cifar10_binary(directory: str, splits: Sequence[str] = SPLITS) -> Tuple[ImageSplit, ...]:
    """Reads `splits` of the extracted official binary release directly: no
    tensorflow-datasets, nothing prepared or written. Checks every file's
    size and labels, so that a truncated, missing or foreign file is one
    clear error instead of a wrong dataset, and that none is a copy of
    another: test_batch.bin copied as a train batch (a missing one
    replaced) trained on the test images, which the test accuracy then
    scored as unseen."""

    extract = (f"extract the archive again (tar xzf {CIFAR10_ARCHIVE} -C "
               f"{os.path.dirname(os.path.abspath(directory))})")

    # Each file's first records, by SHA-256: which file they were. A copy begins as its
    # original does, and no two files of the release share an image. Whole files took
    # 87 ms a load, 100 records each 0.9 ms (2 cores of a Zen 5 EPYC), beside the
    # fingerprint's own pass over every record.
    read_from = {}

    def read(names) -> ImageSplit:
        records = []
        for name in names:
            path = os.path.join(directory, name)
            problem = None
            try:
                size = os.path.getsize(path)
                if size != _BINARY_FILE_BYTES:
                    problem = f"has {size:,} bytes, not {_BINARY_FILE_BYTES:,}"
                else:
                    with open(path, "rb") as f:
                        batch = np.frombuffer(f.read(), np.uint8).reshape(-1, _BINARY_RECORD_BYTES)
                    if batch[:, 0].max() >= INFO.num_classes:
                        problem = f"has labels above {INFO.num_classes - 1}"
                    first = hashlib.sha256(batch[:_COMPARED_RECORDS]).digest()
                    copied = read_from.setdefault(first, name)
                    if copied != name:  # which is the copy, the bytes cannot tell
                        raise DataUnavailableError(
                            f"{directory}: {copied} and {name} begin with the same records, one "
                            f"a copy of the other; {extract}")
            except FileNotFoundError:  # a folder of that name holding something else
                every = ", ".join(n for split in _BINARY_FILES.values() for n in split)
                raise DataUnavailableError(
                    f"{path} is missing: {directory} holds no complete CIFAR-10 binary release "
                    f"({every}), and is read as one by its name; {extract}, or move that "
                    f"folder away") from None
            except OSError as e:
                problem = f"cannot be read ({e.strerror})"
            if problem:
                raise DataUnavailableError(f"{path} {problem}: it is not a file of the CIFAR-10 "
                                           f"binary release; {extract}")
            records.append(batch)
        records = np.concatenate(records)
        # Planes [N, 3, 32, 32] -> NHWC, the layout of every other source
        # (which ImageSplit copies into a buffer TensorFlow can share).
        images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return ImageSplit(images, records[:, 0].astype(np.int32))

    return tuple(read(_BINARY_FILES[split]) for split in splits)


def load_cifar10(data_dir: Optional[str], download: bool,
                 splits: Sequence[str] = SPLITS) -> Tuple[ImageSplit, ...]:
    """Loads `splits` of CIFAR-10 from tensorflow-datasets, preparing it first if needed.

    Fails within seconds, naming the remedies, when the data is not in
    `data_dir` and cannot be downloaded; and with one error naming the file
    and how to prepare it again when the prepared data is damaged.
    """
    import tensorflow_datasets as tfds  # heavy; only runs that need it pay

    _check_dataset_info(data_dir)  # tfds.builder reads it, with tracebacks
    builder = tfds.builder(NAME, data_dir=data_dir)
    if not _is_prepared(builder):
        _prepare_cifar10(builder, download)
    return tuple(_read_prepared_split(builder, split) for split in splits)


def _is_prepared(builder) -> bool:
    """builder.is_prepared(), without the warning tensorflow-datasets logs
    there about a version folder that does not exist yet ("Variant folder
    ... has no dataset_info.json"): a first run is not a damaged one, and
    what is missing is said once, by the error that follows."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        return builder.is_prepared()
    finally:
        absl_logger.setLevel(level)


def _prepare_cifar10(builder, download: bool) -> None:
    """Downloads (or takes from the manual directory) and prepares CIFAR-10,
    or raises DataUnavailableError naming the remedies."""
    import tensorflow_datasets as tfds
    # Not re-exported by tensorflow-datasets' public API.
    from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

    manual_dir = os.path.join(builder.data_dir_root, "downloads", "manual")
    archive = os.path.join(manual_dir, CIFAR10_ARCHIVE)
    # tensorflow-datasets opens it as it is: a directory ended the run with a
    # traceback, and a FIFO would block it.
    if os.path.lexists(archive) and not files.is_regular_file(archive):
        raise DataUnavailableError(
            f"{archive} is {files.kind_of(archive)}, not the CIFAR-10 archive: put the file "
            f"downloaded from https://www.cs.toronto.edu/~kriz/cifar.html there, or remove it")
    have_archive = os.path.exists(archive)
    if have_archive or download:  # preparing writes into data_dir: no download could mend that
        files.check_writable(builder.data_dir_root, flag="--data_dir", create=False)
    if not have_archive:
        reason = None
        if not download:
            reason = "downloading is off (--nodownload)"
        elif not _reachable(*_CIFAR10_HOST, timeout=_NETWORK_PROBE_SECONDS):
            reason = f"{_CIFAR10_HOST[0]} cannot be reached (no network?)"
        if reason:
            raise DataUnavailableError(
                f"CIFAR-10 is not in {builder.data_dir_root} and {reason}. Either extract the "
                f"official binary release there ({CIFAR10_ARCHIVE} from "
                f"https://www.cs.toronto.edu/~kriz/cifar.html: tar xzf {CIFAR10_ARCHIVE} -C DIR "
                f"gives DIR/{CIFAR10_BINARY_DIR}/, read directly with --data_dir=DIR), or run "
                f"`distributed-mpt-prepare-data --data_dir=DIR` on a machine with network and "
                f"copy DIR here (then pass --data_dir=DIR), or put {CIFAR10_ARCHIVE} into "
                f"{manual_dir}, or train on --dataset=synthetic.")
    # Its progress bars, drawn in a log (a Job's, a file's), are lines of
    # spaces and cursor moves, and an error line after them began with one.
    tfds.display_progress_bar(sys.stderr.isatty())
    try:
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    except NonMatchingChecksumError:
        raise DataUnavailableError(
            f"{archive} is not the CIFAR-10 archive "
            f"(its checksum does not match; the real one is 170,052,171 bytes): download it "
            f"again from https://www.cs.toronto.edu/~kriz/cifar.html") from None


def _damaged_data_error(path: str, problem: str, data_dir_root: str,
                        dataset_dir: str) -> DataUnavailableError:
    """The one-line error for prepared data that cannot be read: what is
    wrong with which file, and the two ways to get intact data back."""
    return DataUnavailableError(
        f"{path} {problem}: the prepared CIFAR-10 is damaged. Remove {dataset_dir} and prepare "
        f"it again with `distributed-mpt-prepare-data --data_dir={data_dir_root}`, or, offline, "
        f"extract {CIFAR10_ARCHIVE} into {data_dir_root} (tar xzf {CIFAR10_ARCHIVE} -C "
        f"{data_dir_root}) and pass --data_dir={data_dir_root}: the official binary release "
        f"is read directly.")


def _check_dataset_info(data_dir: Optional[str]) -> None:
    """Raises DataUnavailableError if CIFAR-10's `dataset_info.json` exists
    but does not describe the prepared splits.

    tensorflow-datasets reads this file when the builder is created and
    fails on a damaged one with whatever its parser raised (a protobuf
    ParseError, a UnicodeDecodeError wrapped in a RuntimeError, an
    AssertionError on the version), so the file is parsed here first, with
    tensorflow-datasets' own reader.
    """
    import tensorflow_datasets as tfds
    from google.protobuf import json_format  # a dependency of TensorFlow

    builder_class = tfds.builder_cls(NAME)
    data_dir_root = os.path.expanduser(data_dir or tfds.core.constants.DATA_DIR)
    dataset_dir = os.path.join(data_dir_root, builder_class.name, str(builder_class.VERSION))
    path = os.path.join(dataset_dir, "dataset_info.json")
    if not os.path.exists(path):
        return  # not prepared: load_cifar10 prepares it or says how
    try:
        info = tfds.core.dataset_info.read_from_json(path)
    except (OSError, UnicodeDecodeError, json_format.ParseError) as e:
        problem = f"cannot be read as a dataset description ({first_line(e).rstrip('.')})"
    else:
        split_sizes = {split.name: sum(split.shard_lengths) for split in info.splits}
        if (info.name, info.version) == (builder_class.name, str(builder_class.VERSION)) \
                and split_sizes.get("train") and split_sizes.get("test"):
            return
        problem = (f"does not describe {builder_class.name} {builder_class.VERSION} "
                   f"with its train and test splits")
    raise _damaged_data_error(path, problem, data_dir_root, dataset_dir)


# What reading a prepared split raises when its files are damaged: a record
# that fails its checksum or is cut short, a missing file, fewer records than
# dataset_info.json counts, or a record that does not decode as an image.
def _damaged_record_errors() -> tuple:
    import tensorflow as tf  # only runs that read tensorflow-datasets pay for it here

    return (tf.errors.DataLossError, tf.errors.NotFoundError,
            tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError)


def _read_prepared_split(builder, name: str) -> ImageSplit:
    """The prepared split `name` in memory, or DataUnavailableError naming
    the damaged file."""
    import tensorflow_datasets as tfds

    try:
        # Batches of known size rather than batch_size=-1, which needs the
        # split's size up front.
        batches = list(tfds.as_numpy(
            builder.as_dataset(split=name, as_supervised=True).batch(10_000)))
    except _damaged_record_errors() as e:
        path, problem = _find_damaged_record_file(builder.info.splits[name])
        if path is None:  # every file reads back whole: the records themselves are foreign
            path, problem = builder.data_dir, f"holds unreadable {name} records ({_tf_message(e)})"
        raise _damaged_data_error(path, problem, builder.data_dir_root, builder.data_dir) from None
    images = aligned_empty((sum(len(b[0]) for b in batches), *batches[0][0].shape[1:]), np.uint8)
    np.concatenate([b[0] for b in batches], out=images, casting="unsafe")
    return ImageSplit(images, np.concatenate([b[1] for b in batches]).astype(np.int32))


def _find_damaged_record_file(split_info) -> Tuple[Optional[str], Optional[str]]:
    """The first record file of a split that is missing, fails to read or
    holds another number of records than dataset_info.json says, and what is
    wrong with it; (None, None) if there is none.

    Runs only after reading failed: TensorFlow's errors do not say which of
    the split's files they came from.
    """
    for path, expected in zip(split_info.filepaths, split_info.shard_lengths):
        path = os.fspath(path)
        if not os.path.exists(path):
            return path, "is missing"
        try:
            import tensorflow as tf

            count = sum(1 for _ in tf.data.TFRecordDataset(path))
        except _damaged_record_errors() as e:
            return path, f"is cut short or corrupted ({_tf_message(e)})"
        if count != expected:
            return path, f"holds {count} records, not the {expected} that dataset_info.json counts"
    return None, None


def _tf_message(error) -> str:
    """A TensorFlow error's message without the op and function names."""
    message = re.sub(r"\{\{[^}]*\}\}\s*|\s*\[Op:.*", "", error.message)
    return first_line(message).rstrip(".") or type(error).__name__


def _reachable(host: str, port: int, timeout: float) -> bool:
    """True if a TCP connection to host:port opens within `timeout` seconds.

    Runs in a daemon thread because name resolution ignores socket timeouts.
    """
    reached = []

    def connect():
        with contextlib.suppress(OSError):
            socket.create_connection((host, port), timeout=timeout).close()
            reached.append(True)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(reached)


def load(options, seed: int, splits: Sequence[str] = SPLITS, headroom=None) -> Dataset:
    """The `splits` of CIFAR-10 (`options`: a DataOptions; the seed and the
    headroom are not used: it takes 184 MB): from the official binary
    release when `options.data_dir` holds it (`<data_dir>/cifar-10-batches-bin/`),
    else from tensorflow-datasets, downloaded if `options.download` allows.

    Its fingerprint holds two SHA-256 digests of every label and pixel.
    "sha256" hashes them in order, as the workers of a job compare them:
    each reads its own copy and takes its shard of the examples by index,
    and a copy that is stale, damaged or in another order
    (tensorflow-datasets' is not the release's) trains other examples under
    the same indices. "examples_sha256" (_examples_digest) is blind to the
    order, as a resumed single worker compares it: one started on
    tensorflow-datasets' copy resumes on the binary release's. Both took
    0.22 s of CPU for all 60,000 examples (0.09 s in order, 0.13 s
    order-free; SHA-NI; 2 cores of an AMD EPYC, Zen 5)."""
    binary_dir = find_binary_release(options.data_dir)
    arrays = (load_cifar10_binary(binary_dir, splits) if binary_dir
              else load_cifar10(options.data_dir, options.download, splits))
    digest = hashlib.sha256()
    for split in arrays:  # ImageSplits are C-contiguous: hashed where they lie
        digest.update(split.labels)
        digest.update(split.images)
    return Dataset(INFO, dict(zip(splits, arrays)),
                   {"sha256": digest.hexdigest(), "examples_sha256": _examples_digest(arrays)})


def _examples_digest(arrays: Sequence[ImageSplit]) -> str:
    """The SHA-256 of each split's examples in any order: each image's
    SHA-256 after its label, sorted, and the split's count before them (an
    example moved to another split is other data)."""
    digest = hashlib.sha256()
    for split in arrays:
        count = len(split.labels)
        size = split.images.nbytes // max(count, 1)
        pixels = memoryview(split.images).cast("B")  # each image's bytes, not copied
        hashed = np.frombuffer(b"".join(hashlib.sha256(pixels[i:i + size]).digest()
                                        for i in range(0, count * size, size)), np.uint8)
        keyed = np.concatenate([split.labels.astype("<i4").view(np.uint8).reshape(count, 4),
                                hashed.reshape(count, 32)], axis=1)
        digest.update(count.to_bytes(8, "little"))
        digest.update(np.sort(keyed.view("S36").ravel()))  # bytewise: equal lengths, no padding
    return digest.hexdigest()
