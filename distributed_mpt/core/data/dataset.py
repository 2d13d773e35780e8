"""What a dataset is to the rest of the package: labelled uint8 images in
host memory, and what a model must know of them (their shape, their classes
and the statistics it normalizes with).

A dataset is declared once, as a `DatasetSpec` in `core/data/__init__.py`'s
registry; its loader returns a `Dataset`.
"""

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

from distributed_mpt import files
from distributed_mpt.errors import ConfigError, quoted

SPLITS = ("train", "test")
# The fingerprint's SHA-256 of a held-out test split's decoded pixels (uint8,
# in the split's order): predict --evaluate draws the split again by its file
# names, and the same names may hold other photos (check_held_out_split).
HELD_OUT_PIXELS = "held_out_pixels_sha256"
# The flags (DataOptions' and the seed) that draw and size that split, besides its files.
HELD_OUT_FLAGS = ("image_size", "test_fraction", "seed")
# What of the fingerprint draws that split, with the seed and --test_fraction.
_DRAWN_BY = ("classes", "files", "names_sha256")


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """A split held in memory: uint8 images [N, H, W, C] and int32 labels [N]
    (integer labels of another dtype are converted)."""

    images: "np.ndarray"  # noqa: F821 - NumPy is the loaders' to import, not the registry's
    labels: "np.ndarray"  # noqa: F821

    def __post_init__(self):
        import numpy as np

        # 64-byte aligned, so that the input pipeline shares these buffers
        # with TensorFlow instead of copying them (pipeline._host_tensors):
        # copied once, if TensorFlow cannot share them as they are.
        labels = np.asarray(self.labels)
        # NumPy's default integers are int64, which a loader in the package
        # may well hand over; the step compares labels with int32 predictions,
        # and int64 ones failed there, blamed on the model.
        if labels.dtype != np.int32 and np.issubdtype(labels.dtype, np.integer):
            object.__setattr__(self, "labels", labels.astype(np.int32))
        for name in ("images", "labels"):
            array = np.asarray(getattr(self, name))
            if array.size and not shareable(array):
                aligned = aligned_empty(array.shape, array.dtype)
                aligned[...] = array
                array = aligned
            object.__setattr__(self, name, array)

    def __len__(self) -> int:
        return len(self.labels)


# What TensorFlow requires of a buffer it shares (Eigen's largest alignment).
ALIGNMENT = 64


def shareable(array) -> bool:
    """Whether TensorFlow can take `array`'s buffer as it is (DLPack):
    C-contiguous and ALIGNMENT-byte aligned (TensorFlow aborts the process
    otherwise), writeable (NumPy's rule for exporting it) and not empty."""
    return bool(array.flags.c_contiguous and array.flags.writeable and array.size
                and array.ctypes.data % ALIGNMENT == 0)


def aligned_empty(shape, dtype):
    """An uninitialized C-contiguous array that TensorFlow can share: what
    the loaders fill, so that an ImageSplit never copies a split to align it.
    NumPy starts large arrays 16 bytes past a page (glibc's chunk header)."""
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buffer = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % ALIGNMENT
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a model is built for and an export records: the images' shape,
    the class names in label order, and the per-channel mean and standard
    deviation of the training images on the 0-255 scale (models normalize
    their uint8 input with them)."""

    image_shape: Tuple[int, int, int]
    class_names: Tuple[str, ...]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


# Far above any classifier trained here (ImageNet-21k has 21,841 classes): a
# config.json that lists more was not written by a run, and a model built for
# a million classes took 12.9 GB before predict could refuse it (2 cores of
# an AVX2-only AMD EPYC, Zen 3).
MAX_CLASSES = 100_000
# Unicode's default-ignorable code points (DerivedCoreProperties.txt): drawn
# as nothing, so two names that differ only by them print the same. Format
# characters (Cf) are the rest of them, found by category.
_IGNORABLE = re.compile("[\u00ad\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164"
                        "\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]")


def read_as(name: str) -> str:
    """What a person reads in the class name `name`: without its invisible
    characters and the spaces at its ends, in NFKC's compatibility forms,
    case folded. Two names read the same are one class to a reader, and
    print as one in predict's answers."""
    import unicodedata  # an extension module, loaded where it is used

    visible = _IGNORABLE.sub("", "".join(c for c in name if unicodedata.category(c) != "Cf"))
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", visible.strip())
                                 .casefold()).strip()


# How two names that read_as makes one differ, for the messages that name them.
READ_AS_ONE_BY = "case, Unicode form, invisible characters or spaces at their ends"


def first_pair_read_as_one(names) -> Optional[Tuple[str, str]]:
    """The first two of `names` (in their order) that read_as makes one, or
    None: two classes a person reads, and predict prints, as one."""
    seen: Dict[str, str] = {}
    for name in names:
        key = read_as(name)
        if key in seen:
            return seen[key], name
        seen[key] = name
    return None


def class_names_problem(names) -> Optional[str]:
    """What is wrong with `names` as a classifier's class names (at least two
    and at most MAX_CLASSES strings, none empty, no two read as one), or None."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return "its class names are not a list of names"
    if not 2 <= len(names) <= MAX_CLASSES:
        return (f"it names {len(names):,} class{'' if len(names) == 1 else 'es'}, where a "
                f"classifier has 2 to {MAX_CLASSES:,}")
    if "" in names:  # no class folder, no line of classes.txt, is empty
        return f"its class name {names.index('') + 1} of {len(names):,} is empty"
    pair = first_pair_read_as_one(names)
    if pair:
        return (f"class names {quoted(pair[0])} and {quoted(pair[1])} read as one (they differ "
                f"only in {READ_AS_ONE_BY})")
    return None


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A loaded dataset: its `info`, the splits that were asked for, and its
    `fingerprint`: what a resumed run compares to tell whether it continues
    on the same data, and the workers of a job whether they read the same (a
    JSON-able dict: an image folder's classes, number of files and digests
    of its file list and of a held-out split's pixels; digests of CIFAR-10's
    contents, in order and in any order: see same_examples). None where the flags
    say what the data is: synthetic data is made from the seed and the size,
    and those flags are compared already."""

    info: DatasetInfo
    splits: Dict[str, ImageSplit]
    fingerprint: Optional[dict] = None
    # Whether the test split was drawn from the training files (--test_fraction):
    # drawn again from another list of them, it holds some the model trained on.
    held_out: bool = False

    @property
    def train(self) -> ImageSplit:
        return self.splits["train"]

    @property
    def test(self) -> ImageSplit:
        return self.splits["test"]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A dataset the package can train on: its name (the --dataset value),
    one line saying what it is, and its loader as "module:function" (imported
    only to load: flags are checked, and a stop obeyed, before NumPy or
    TensorFlow start a thread), a `(DataOptions, seed, splits, headroom)
    -> Dataset` that returns the `splits` asked for (reading only those) or
    raises DataUnavailableError saying what is missing and how to get it, or
    that they take more memory than `headroom` (process/memory.py's, or
    None: unknown). `flip`
    is its default of --flip: random where a mirror image is the same class
    (CIFAR-10's photos), none where it may not be (digits, text). `reads`:
    the DataOptions its loader reads besides --data_dir and --download; an
    export records them (model_info.json), so that predict --evaluate
    rebuilds its test split as it was trained."""

    name: str
    summary: str
    loader: str
    reads: Tuple[str, ...] = ()
    # What --data_dir must hold when the dataset cannot be read without it
    # (the check's error says so); "": it can.
    needs_data_dir: str = ""
    flip: str = "random"


def channel_statistics(images):
    """The mean and standard deviation of each channel of uint8 [N, H, W, C]
    `images` (NumPy arrays of float64)."""
    import numpy as np

    mean = images.mean(axis=(0, 1, 2), dtype=np.float64)
    variance = np.zeros(images.shape[-1])
    # Chunks of 4M values (32 MB as float64): 4,096 images a chunk took 26 GB at 512 x 512.
    step = max(1, (1 << 22) // images[0].size)
    for start in range(0, len(images), step):
        chunk = images[start:start + step].astype(np.float64) - mean
        variance += (chunk * chunk).sum(axis=(0, 1, 2))
    return mean, np.sqrt(variance / (images.size // images.shape[-1]))


def same_examples(before: dict, now: dict, pixels: bool = False) -> bool:
    """Whether a resumed run's data is its own: `before` as a config.json
    recorded it (read, not trusted), `now` as loaded. Where both hold the
    order-free "examples_sha256", the ordered "sha256" is left out: a single
    worker draws its batches from the whole split, and a copy listing the
    same examples in another order trains the same data (the rest of an
    epoch cut short draws other examples, as another seed would); the
    workers of a job compare the whole fingerprint, order too. A record from
    before it was kept is compared in order: refused unless the same. An
    image folder's "names_sha256" is in its "sha256" too (a record from
    before it was kept lacks it); its HELD_OUT_PIXELS only if `pixels` (the
    run's HELD_OUT_FLAGS unchanged: changed, they change the pixels, and the
    refusal names them), and if recorded (a record from before lacks them):
    the same names and sizes may hold photos moved among them."""
    left_out = {"sha256" if "examples_sha256" in before and "examples_sha256" in now
                else "examples_sha256", *({"names_sha256"} - set(before))}
    if not (pixels and HELD_OUT_PIXELS in before):
        left_out.add(HELD_OUT_PIXELS)
    return ({k: v for k, v in before.items() if k not in left_out}
            == {k: v for k, v in now.items() if k not in left_out})


def warn_of_copies(listed: Dict[str, List[Tuple[str, int]]], digests: Dict[str, List[bytes]],
                   held_out: bool) -> None:
    """Warns if test images of `listed` ({split: [(path, label)]}) are
    byte-for-byte copies of training images, by `digests` (of each file's
    bytes, in that order): the test accuracy counts them as unseen. Not
    refused, as links are: a collection gathered from the web holds a few."""
    trained = dict(zip(digests["train"], (path for path, _ in listed["train"])))
    copies = [f"{quoted(path)} of {quoted(trained[digest])}" for digest, (path, _) in
              zip(digests["test"], listed["test"]) if digest in trained]
    if copies:  # each path quoted alone: two long ones would pass quoted()'s limit together
        are = "is a byte-for-byte copy" if len(copies) == 1 else "are byte-for-byte copies"
        more = f" and {len(copies) - 2} more" if len(copies) > 2 else ""
        files.warn(f"{len(copies)} of the {len(listed['test'])} test images {are} of "
                   f"training images ({', '.join(copies[:2])}{more}): the test "
                   f"accuracy counts them as unseen; remove "
                   f"{'one of each' if held_out else 'them from test/'}")


def some_names(names, shown: int = 5) -> str:
    """Names for a message: the first `shown`, and how many more."""
    names = list(names)
    return ", ".join(quoted(str(name)) for name in names[:shown]) + (
        f" and {len(names) - shown} more" if len(names) > shown else "")


def fingerprint_difference(before: dict, now: dict, pixels: bool = False) -> str:
    """What differs between two of `Dataset.fingerprint`, in words: `before`
    as a config.json recorded it (read, not trusted), `now` as loaded; with
    `pixels`, their HELD_OUT_PIXELS (see same_examples) too."""
    if (pixels and HELD_OUT_PIXELS in before and before[HELD_OUT_PIXELS] != now.get(
            HELD_OUT_PIXELS) and _same(before, now, _DRAWN_BY)):
        return ("the same classes and file names, but other images in its held-out test split "
                "(the SHA-256 of their pixels differs: photos moved among the names or changed, "
                "or decoded by another version of Pillow)")

    def field(fingerprint, name, kind):  # config.json is read, not trusted: any shape
        value = fingerprint.get(name)
        return value if isinstance(value, kind) else kind()

    old, new = field(before, "classes", list), field(now, "classes", list)
    removed, added = [c for c in old if c not in new], [c for c in new if c not in old]
    parts = []
    if removed:
        parts.append(f"class(es) {some_names(removed)} gone")
    if added:
        parts.append(f"class(es) {some_names(added)} new")
    if old != new and not parts:
        parts.append(f"the classes in another order ({some_names(new)}, was {some_names(old)})")
    counted_before, counted = field(before, "files", dict), field(now, "files", dict)
    for split in sorted(set(counted_before) | set(counted)):
        if counted_before.get(split) != counted.get(split):
            parts.append(f"{split}/ holds {counted.get(split, 0)} files (was "
                         f"{counted_before.get(split, 0)})")
    if parts or "files" in before:
        return "; ".join(parts) or ("the same classes and numbers of files, but other file "
                                    "names or sizes (the SHA-256 of the list of files and sizes "
                                    "differs)")
    if "examples_sha256" in before:  # CIFAR-10's: no files to count
        return "other labels or pixels (the SHA-256 of the examples, in any order, differs)"
    return ("other labels or pixels, or the same in another order (the SHA-256 of the labels "
            "and pixels, in order, differs)")


def check_held_out_split(dataset: Dataset, trained_on, data_dir: str) -> None:
    """For evaluating a model on `dataset`, read from `data_dir`: if its test
    split is held out of the training files, raises ConfigError unless
    `trained_on` (the fingerprint of the model's training data, as its export
    or config.json recorded it: read, not trusted) is `dataset`'s. Images
    added or removed since move others into the split, some the model
    trained on, and its accuracy reads higher than it is, unsaid. Unknown (a
    model from before it was recorded, a loader that gives none): warned."""
    if not dataset.held_out:
        return
    if not isinstance(trained_on, dict) or dataset.fingerprint is None:
        whose = "the model records" if dataset.fingerprint else "its dataset's loader gives"
        files.warn(f"cannot tell whether --data_dir={quoted(data_dir)} holds the images the "
                   f"model trained on ({whose} no fingerprint of them): if images were added "
                   f"or removed since, its test split held out of them (--test_fraction) holds "
                   f"some it trained on, and the accuracy reads too high")
    elif not _same_held_out_split(trained_on, dataset.fingerprint):
        difference = fingerprint_difference(trained_on, dataset.fingerprint, pixels=True)
        raise ConfigError(
            f"--data_dir={quoted(data_dir)} is not the folder the model trained on, or has "
            f"changed since ({difference}): the test split held "
            f"out of it (--test_fraction) would mix in images the model trained on; evaluate on "
            f"a test/ folder of images it never saw (DATA_DIR/test/<class>/), or on the folder "
            f"as it trained")


def _same_held_out_split(before: dict, now: dict) -> bool:
    """Whether an image folder's held-out split, as `now` fingerprints it,
    holds the images of the one `before` (read, not trusted) recorded: the
    same _DRAWN_BY and the same pixels, whatever the files' sizes (PNGs
    re-saved losslessly hold out the images the model never saw); by the
    same names and sizes where `before` has no pixels' digest (an export
    from before HELD_OUT_PIXELS was kept)."""
    if HELD_OUT_PIXELS not in before:
        return same_examples(before, now)
    return _same(before, now, (*_DRAWN_BY, HELD_OUT_PIXELS))


def _same(before: dict, now: dict, keys) -> bool:
    """Whether two fingerprints agree on `keys` (`before` read, not trusted: any may lack)."""
    return all(before.get(k) == now.get(k) for k in keys)
