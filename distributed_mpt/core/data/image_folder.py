"""Your own labelled images: one folder per class, the layout of
`keras.utils.image_dataset_from_directory`, torchvision's `ImageFolder` and
TFDS' `ImageFolder`.

    DATA_DIR/train/<class name>/<image files>
    DATA_DIR/test/<class name>/<image files>   (or a --test_fraction of train/ held out)

The classes are train/'s folders in sorted order (label i names the i-th),
at least two, named in UTF-8 without control characters (they are lines of
the export's classes.txt), no two that read as one (equal but for case,
NFKC's compatibility forms, invisible characters or spaces at their ends);
test/ may hold only those (a class it holds no images of is named in a
warning: the test accuracy leaves it out), and --test_fraction holds out a
share of train/ only where there is no test/. Every image is decoded once
into uint8 RGB of `image_size` x `image_size` in host memory
(core/data/images.py: Pillow, its first frame, turned as its EXIF
orientation says); entries whose name starts with a dot (.DS_Store,
.ipynb_checkpoints/, editors' swap files), the files systems leave beside a
user's (Thumbs.db, desktop.ini, an unzipped archive's __MACOSX/, a NAS's
@eaDir/) and files beside the class folders are skipped, all named in one
warning, and anything else that is not an intact image (a link among the
class folders that leads nowhere too) is one error naming it; test images
that are byte-for-byte copies of training images are named in a warning
(dataset.warn_of_copies). The mean and standard deviation the model
normalizes with are the training images'.

The dataset's fingerprint is its classes, its number of files and SHA-256
digests: of its file list with their sizes, which a resume compares (so as
not to continue on other images: training/plan.py); of the list alone and of
a held-out split's pixels, which predict --evaluate compares to draw it again,
and a resume too (the same names and sizes may hold photos moved among them).
"""

import contextlib
import errno
import hashlib
import os
import stat
import unicodedata
from typing import Dict, List, Sequence, Tuple

import numpy as np

from distributed_mpt import files
from distributed_mpt.core.data import IMAGE_FOLDER_LAYOUT as LAYOUT
from distributed_mpt.core.data import images
from distributed_mpt.core.data.dataset import (
    HELD_OUT_PIXELS, MAX_CLASSES, READ_AS_ONE_BY, SPLITS, Dataset, DatasetInfo, ImageSplit,
    aligned_empty, channel_statistics, first_pair_read_as_one, read_as, some_names, warn_of_copies)
from distributed_mpt.errors import ConfigError, DataUnavailableError, quoted, too_long_to_open

NAME = "image_folder"
# A name's characters that would break classes.txt (one name a line, read
# back with str.splitlines) or are not UTF-8 (surrogates stand for the bytes
# that are not): control characters, line and paragraph separators.
_BAD_IN_NAMES = ("Cc", "Cs", "Zl", "Zp")
# What operating systems leave beside a user's images, as macOS leaves
# .DS_Store: Windows' thumbnail caches and folder settings, the folder of
# macOS's resource forks that another system's unzip makes, and the folder
# of thumbnails a Synology NAS makes in every folder it indexes. As a class
# folder it trained a class of its own; among the images it was refused.
_SYSTEMS_FILES = ("thumbs.db", "ehthumbs.db", "desktop.ini", "__macosx", "@eadir")
_LAID_OUT = f"an image folder is laid out as {LAYOUT}"


def load(options, seed: int, splits: Sequence[str] = SPLITS, headroom=None) -> Dataset:
    """The `splits` of the image folder `options.data_dir` (a DataOptions;
    see the module's docstring), a held-out test split drawn with `seed`;
    raises DataUnavailableError naming what is missing, or naming
    `headroom` (process/memory.py's: the memory left to this process) if
    the decoded images would take more."""
    root, fraction = options.data_dir, options.test_fraction
    train_dir, test_dir = os.path.join(root, "train"), os.path.join(root, "test")
    for folder, missing in ((root, "does not exist"), (train_dir, "has no train/ folder")):
        if not _is_folder_at(folder):  # a file there: named as what it is
            raise DataUnavailableError(f"--data_dir={quoted(root)} {missing}: {_LAID_OUT}")
    has_test = _is_folder_at(test_dir)
    if has_test and fraction > 0 and "train" in splits:  # evaluating alone (predict): test/ is it
        raise ConfigError(f"--test_fraction={fraction:g} holds out training images "
                          f"for testing, and {quoted(test_dir)} holds test images already: drop "
                          f"--test_fraction, or move test/ away")
    skipped: List[str] = []
    class_names = _class_folders(train_dir, skipped)
    _check_class_names(train_dir, class_names)
    train_files = _files_by_class(train_dir, class_names, skipped)
    listed = {"train": train_files}
    if has_test:
        test_files = listed["test"] = _files_by_class(test_dir, class_names, skipped,
                                                      train_dir=train_dir)
        if "test" in splits and not any(test_files.values()):
            raise DataUnavailableError(f"{quoted(test_dir)} holds no images: put some of each "
                                       f"class there ({LAYOUT}), or move it away and pass "
                                       f"--test_fraction to hold out a share of train/")
    elif fraction > 0:
        train_files, test_files = _hold_out(train_files, fraction, seed)
    else:
        raise DataUnavailableError(f"--data_dir={quoted(root)} has no test/ folder: add one "
                                   f"({LAYOUT}), or pass --test_fraction to hold out a share of "
                                   f"train/ for testing")
    if skipped:  # one line, however many: a .DS_Store in every folder is common
        files.warn(f"skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of "
                   f"{quoted(root)} that are not class folders or images (a name starting with "
                   f"a dot, a system's own such as Thumbs.db, or beside the class folders what "
                   f"is not a folder): "
                   f"{some_names(os.path.relpath(path, root) for path in sorted(skipped))}")
    # Checked on the splits as drawn: links in one class may fall on both sides of a held-out one.
    sizes = _each_file_once({"train": train_files, "test": test_files})
    fingerprint = _fingerprint(root, class_names, listed, sizes)
    size = (options.image_size, options.image_size)
    # Train in a fixed shuffled order, not by class: what is computed from the
    # first images (airbench's whitening takes 5,000) must see every class.
    # Its statistics are the model's, whichever splits are read.
    order = np.random.default_rng(0).permutation(sum(map(len, train_files.values())))
    in_order = {"train": _labelled(train_files, order)}
    if "test" in splits:
        in_order["test"] = _labelled(test_files)
    room, digests = _room_for(root, in_order, size, headroom), {}
    decoded = {split: _decode(pairs, room[split], size, digests.setdefault(split, []))
               for split, pairs in in_order.items()}
    if "test" in splits:
        warn_of_copies(in_order, digests, held_out=not has_test)
    if "test" in splits and not has_test:  # 10,000 32x32 images: 15 ms, decoded 2-3 s (Zen 5)
        fingerprint[HELD_OUT_PIXELS] = hashlib.sha256(decoded["test"].images).hexdigest()
    mean, std = channel_statistics(decoded["train"].images)
    info = DatasetInfo(image_shape=(*size, 3), class_names=tuple(class_names),
                       mean=tuple(round(float(m), 4) for m in mean),
                       std=tuple(round(float(max(s, 1.0)), 4) for s in std))
    return Dataset(info, {split: decoded[split] for split in splits}, fingerprint, held_out=not has_test)


def _class_folders(directory: str, skipped: List[str]) -> List[str]:
    """The class folders in `directory`, sorted; what else is there goes to
    `skipped`, by its path."""
    names = []
    for entry in _entries(directory):
        if _skipped_by_name(entry.name):
            skipped.append(entry.path)
        elif _is_folder(entry):
            names.append(entry.name)
        elif entry.is_symlink() and not os.path.exists(entry.path):
            # It stands where a class folder may have been: skipped, the run
            # would train without that class (as a link among the images is refused).
            raise DataUnavailableError(f"{quoted(entry.path)} is {files.kind_of(entry.path)}, "
                                       f"among the class folders: point it at its folder of "
                                       f"images, or move it away")
        else:
            skipped.append(entry.path)
    if not names:
        raise DataUnavailableError(f"{quoted(directory)} holds no class folders: {_LAID_OUT}")
    return sorted(names)


def _skipped_by_name(name: str) -> bool:
    """Whether an entry named `name` is skipped whatever it is: hidden (a
    dot first), or a system's own (_SYSTEMS_FILES, named in any case, as
    Windows matches them)."""
    return name.startswith(".") or name.casefold() in _SYSTEMS_FILES


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether `entry` is a folder or a link to one; a link in a loop is not."""
    try:
        return entry.is_dir()
    except OSError:  # ELOOP
        return False


def _check_class_names(directory: str, names: List[str]) -> None:
    """Raises DataUnavailableError, before any image is decoded, unless there
    are 2 to MAX_CLASSES classes, no two read as one (dataset.read_as), and
    each name is one line of UTF-8 text with a visible character: the export
    writes them into classes.txt, and predict answers with them."""
    for name in names:
        bad = next((c for c in name if unicodedata.category(c) in _BAD_IN_NAMES), None)
        if bad is None and read_as(name):
            continue
        folder = quoted(os.path.join(directory, name))
        if bad is None:  # spaces or invisible characters alone
            raise DataUnavailableError(f"class folder {folder} has no visible character in its "
                                       f"name: rename it (predict answers with class names)")
        if unicodedata.category(bad) == "Cs":
            raise DataUnavailableError(f"class folder {folder} is named in bytes that are not "
                                       f"UTF-8: rename it (the export's classes.txt is UTF-8)")
        raise DataUnavailableError(f"class folder {folder} has a control character (U+"
                                   f"{ord(bad):04X}) in its name: rename it (class names are "
                                   f"the lines of the export's classes.txt)")
    # Two classes that a person reads, and predict prints, as one, each with part of its images.
    pair = first_pair_read_as_one(names)
    if pair:
        raise DataUnavailableError(
            f"class folders {quoted(os.path.join(directory, pair[0]))} and {quoted(pair[1])} "
            f"read as one name (they differ only in {READ_AS_ONE_BY}) but are two classes: "
            f"merge them, or rename one")
    if len(names) < 2:
        raise DataUnavailableError(f"{quoted(directory)} holds one class folder "
                                   f"({quoted(names[0])}): a classifier needs two classes or "
                                   f"more, a folder of images of each")
    if len(names) > MAX_CLASSES:  # predict refuses a run of more, as damaged: refused before it
        raise DataUnavailableError(f"{quoted(directory)} holds {len(names):,} class folders, "
                                   f"more than this program trains ({MAX_CLASSES:,}): merge some")


def _files_by_class(directory: str, class_names: List[str], skipped: List[str],
                    train_dir: str = "") -> Dict[int, List[str]]:
    """{label: the image files of its folder in `directory`, sorted}; the
    entries skipped go to `skipped`."""
    if train_dir:
        unknown = sorted(set(_class_folders(directory, skipped)) - set(class_names))
        # The first may be a class spelled another way (a name in NFD, as
        # macOS writes it): printed, the two look the same.
        pair = first_pair_read_as_one([*class_names, *unknown])
        if pair and pair[0] in class_names:
            fix = ("merge it into the one spelled as in train/" if pair[0] in
                   _class_folders(directory, []) else "rename the one in test/ as in train/")
            raise DataUnavailableError(
                f"class folders {quoted(os.path.join(directory, pair[1]))} and "
                f"{quoted(os.path.join(train_dir, pair[0]))} read as one name but are spelled "
                f"differently (in {READ_AS_ONE_BY}): {fix}")
        if unknown:
            raise DataUnavailableError(
                f"{quoted(directory)} has class folder(s) "
                f"{quoted(', '.join(unknown))} that {quoted(train_dir)} does not: "
                f"a model learns only the classes it trains on")
    found, without = {}, []
    for label, name in enumerate(class_names):
        folder = os.path.join(directory, name)
        paths = []
        for entry in _entries(folder, missing_ok=bool(train_dir)):
            if not _skipped_by_name(entry.name) and _is_folder(entry):
                # Keras and torchvision read such folders: said as "not a regular file",
                # the user who came from them did not see what to do.
                raise DataUnavailableError(
                    f"{quoted(entry.path)} is a folder in class folder {quoted(folder)}, whose "
                    f"images are read from that folder alone ({LAYOUT}): move its images up "
                    f"into {quoted(folder)}, or make it a class folder of its own")
            (skipped if _skipped_by_name(entry.name) else paths).append(entry.path)
        if not paths and not train_dir:
            raise DataUnavailableError(f"{quoted(folder)} holds no images: every class needs "
                                       f"training images")
        if not paths:
            without.append(name)
        found[label] = sorted(paths)
    # A class without test images is left out of the test accuracy, which
    # reads as the model's on every class. None at all is load's error.
    if without and len(without) < len(class_names):
        files.warn(f"{quoted(directory)} holds no images of {len(without)} of the "
                   f"{len(class_names)} classes ({some_names(without)}): the test accuracy says "
                   f"nothing of them; put test images of each class in its folder there")
    return found


def _is_folder_at(path: str) -> bool:
    """Whether `path` is a folder (or a link to one), False if nothing is
    there; DataUnavailableError if something else is (a file, a link that
    leads nowhere: "no test/ folder" sent the user looking for what is
    there), or where it cannot be told (a path too long to open, a folder
    above it not readable), which is not the same as its absence."""
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            return True
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.lexists(path):
            return False
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise _unreadable(path, e) from None
    raise DataUnavailableError(f"{quoted(path)} is {files.kind_of(path)}, not a folder: "
                               f"{_LAID_OUT}")


def _entries(folder: str, missing_ok: bool = False) -> List[os.DirEntry]:
    """The entries of `folder` (none if it is missing and `missing_ok`),
    or DataUnavailableError naming it and why it cannot be read."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as e:
        if missing_ok and e.errno in (errno.ENOENT, errno.ENOTDIR):
            return []
        raise _unreadable(folder, e) from None


def _unreadable(path: str, error: OSError) -> DataUnavailableError:
    if error.errno == errno.ENAMETOOLONG:
        return DataUnavailableError(f"cannot open {too_long_to_open(path)}: move --data_dir "
                                    f"to a shorter path, or shorten its folders' names")
    if error.errno == errno.EACCES:  # named by the folder closed to this user: DIR, not DIR/train
        above = [os.path.abspath(path)]
        while above[-1] != os.path.dirname(above[-1]):
            above.append(os.path.dirname(above[-1]))
        path = next((folder for folder in reversed(above[1:]) if not os.access(folder, os.X_OK)),
                    path)
    return DataUnavailableError(f"cannot read {quoted(path)} ({error.strerror})")


def _each_file_once(listed: Dict[str, Dict[int, List[str]]]) -> Dict[str, int]:
    """Every listed file's size in bytes (-1 if unknown: decoding names it),
    or DataUnavailableError if two paths of two classes or splits are one
    file (links): a class folder linked under two names trained its images
    as both classes, and test/ linked to train/ scored the model on its
    training images, unsaid. In one class, links to one image (what
    hardlink(1) or rdfind make of duplicates) train as copies would."""
    sizes, seen = {}, {}
    for path, place in [(p, (split, label)) for split, by_class in listed.items()
                        for label, ps in by_class.items() for p in ps]:
        try:
            found = os.stat(path)
        except OSError:  # a link to nothing, or one that loops
            sizes[path] = -1
            continue
        sizes[path] = found.st_size
        first, first_place = seen.setdefault((found.st_dev, found.st_ino), (path, place))
        if first_place != place and found.st_ino:  # 0: a file system without inode numbers
            pair, folders = [first, path], [os.path.dirname(first), os.path.dirname(path)]
            with contextlib.suppress(OSError):  # one folder (a class's, a split's): named so
                pair = folders if os.path.samefile(*folders) else pair
            raise DataUnavailableError(
                f"{quoted(pair[0])} and {quoted(pair[1])} are one (a link, or hard links): an "
                f"image belongs to one class of train/ or of test/ alone; remove one of them")
    return sizes


def _fingerprint(root: str, class_names: List[str], listed: Dict[str, Dict[int, List[str]]],
                 sizes: Dict[str, int]) -> dict:
    """What the folder `root` holds, cheaply: its classes in label order, its
    number of files in each split folder, and the SHA-256 of every file's
    path (from `root`: a copy elsewhere is the same data) and `sizes`,
    sorted ("names_sha256": of the paths alone, which draw a held-out split).
    Contents are not read for it: a file changed in place at the same size
    goes unnoticed (but in a held-out split: load), one added, removed,
    renamed, moved to another class or resized does not."""
    named = {os.fsencode(os.path.relpath(path, root)): sizes[path] for by_class in
             listed.values() for paths in by_class.values() for path in paths}
    names, sized = sorted(named), sorted(name + b"\t%d" % size for name, size in named.items())
    return {"classes": list(class_names),
            "files": {split: sum(map(len, by_class.values()))
                      for split, by_class in listed.items()},
            "sha256": hashlib.sha256(b"\n".join(sized)).hexdigest(),
            "names_sha256": hashlib.sha256(b"\n".join(names)).hexdigest()}


def _hold_out(files: Dict[int, List[str]], fraction: float, seed: int) -> Tuple[dict, dict]:
    """(train, test): `fraction` of each class's files, chosen by `seed`,
    held out for testing (at least one per class), the rest kept in order."""
    train, test = {}, {}
    for label, paths in files.items():
        count = max(1, round(fraction * len(paths)))
        if count >= len(paths):
            raise DataUnavailableError(
                f"--test_fraction={fraction:g} leaves no training image of class {label} "
                f"({len(paths)} image(s)): lower it, or add a test/ folder")
        held = set(np.random.default_rng([seed, label]).permutation(len(paths))[:count])
        train[label] = [p for i, p in enumerate(paths) if i not in held]
        test[label] = [p for i, p in enumerate(paths) if i in held]
    return train, test


def _labelled(by_class: Dict[int, List[str]], order=None) -> List[Tuple[str, int]]:
    """(path, label) of every file of `by_class`, by class, or taken in
    `order` (indices into that)."""
    pairs = [(path, label) for label, paths in by_class.items() for path in paths]
    return pairs if order is None else [pairs[i] for i in order]


def _room_for(root: str, listed: Dict[str, list], size: Tuple[int, int], headroom
              ) -> Dict[str, np.ndarray]:
    """Uninitialized uint8 arrays for the images of every split of `listed`,
    all taken before the first is decoded: a folder larger than `headroom`
    or the memory the system gives is one error line at once. A container's
    limit does not refuse the arrays (pages are taken as they are written):
    the OOM killer ended the run as it decoded (exit 137, no word); past the
    host's memory it was a MemoryError's traceback."""
    count = sum(map(len, listed.values()))
    needed = count * size[0] * size[1] * 3
    try:
        if headroom is None or needed <= headroom.bytes:
            return {split: aligned_empty((len(pairs), *size, 3), np.uint8)
                    for split, pairs in listed.items()}
        than = f"the {headroom.describe()}"
    except MemoryError:
        than = "this process could get"
    raise DataUnavailableError(
        f"the {count:,} images of {quoted(root)} take {needed / 1e9:.1f} GB of memory at "
        f"--image_size={size[0]}, more than {than}: lower --image_size, or give the run more "
        f"memory")


def _decode(pairs: List[Tuple[str, int]], pixels: np.ndarray, size: Tuple[int, int],
            digests: List[bytes]) -> ImageSplit:
    """The files of `pairs` (path, label) decoded into `pixels`, in order,
    with their labels; the SHA-256 of each file's bytes appended to `digests`
    (2 us for a 3 kB PNG, decoded in 170 to 290: 2 loaded cores of an EPYC)."""
    for index, (path, _) in enumerate(pairs):
        encoded = images.file_bytes(path)
        digests.append(hashlib.sha256(encoded).digest())
        # A damaged file, or one that is not an image, is ImageError (a
        # UserError) naming it: one error line, before any training.
        pixels[index] = images.read_image(path, size, encoded)
    return ImageSplit(pixels, np.array([label for _, label in pairs], np.int32))
