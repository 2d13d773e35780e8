"""The datasets the package trains on, declared once each in `DATASETS`.

Adding one means a module with a
`load(options, seed, splits, headroom) -> Dataset` (headroom: the memory
the run may still take, None where unknown; a split that would take more
is refused) and a line below (docs/extending.md); --dataset, --help, the checks,
the export's record and predict take it from here. The loaders are imported
only to load.
"""

import dataclasses
import importlib
from typing import Optional, Sequence

from distributed_mpt.core.data.dataset import (SPLITS, Dataset, DatasetInfo, DatasetSpec,
                                               ImageSplit)
from distributed_mpt.options import (MAX_EXAMPLES, Options, option, require, require_at_most,
                                     require_positive)

_HERE = "distributed_mpt.core.data"
IMAGE_FOLDER_LAYOUT = "DATA_DIR/train/<class>/<images> and DATA_DIR/test/<class>/<images>"
DATASETS = {spec.name: spec for spec in (
    DatasetSpec("cifar10", "CIFAR-10 from its official binary release in --data_dir, or "
                "tensorflow-datasets (downloaded unless --nodownload)", f"{_HERE}.cifar10:load"),
    DatasetSpec("synthetic", "CIFAR-shaped data with learnable labels, made from --seed "
                "(no download)", f"{_HERE}.synthetic:load", reads=("synthetic_examples",)),
    # Not flipped unless asked: a mirrored digit or letter is another sign.
    DatasetSpec("image_folder", f"your own labelled images in --data_dir: {IMAGE_FOLDER_LAYOUT}, "
                f"resized to --image_size", f"{_HERE}.image_folder:load", flip="none",
                reads=("image_size", "test_fraction"),
                needs_data_dir="the folder of class folders (DATA_DIR/train/<class>/<images>)"),
)}


# Three pooling stages need 8 pixels; 512 squared is 768 KB an image in memory.
_MIN_IMAGE_SIZE, _MAX_IMAGE_SIZE = 8, 512


@dataclasses.dataclass(frozen=True)
class DataOptions(Options):
    """Which data a run trains on, and how it is read."""

    dataset: str = option("cifar10", " ".join(
        f"{spec.name}: {spec.summary}." for spec in DATASETS.values()), tuple(DATASETS))
    data_dir: Optional[str] = option(
        None, "Where the data is. cifar10: a directory holding the official binary release "
        "(cifar-10-batches-bin/, read directly), or a tensorflow-datasets data directory "
        "(default ~/tensorflow_datasets). image_folder: the folder of class folders.")
    download: bool = option(True, "Download and prepare CIFAR-10 if it is not in --data_dir. "
                            "Turn off on workers that must read prepared data.")
    synthetic_examples: int = option(50_000, "Training examples of --dataset=synthetic (test: "
                                     "a fifth as many).")
    image_size: int = option(32, "--dataset=image_folder: images are resized to this many "
                             "pixels square (squashed, not cropped).")
    test_fraction: float = option(
        0.0, "--dataset=image_folder without a test/ folder: hold out this fraction of each "
        "class's training images (chosen by --seed) for testing (beside a test/ folder: an "
        "error).")

    def check(self) -> None:
        needs = DATASETS[self.dataset].needs_data_dir  # a choice: checked before this
        require(not needs or bool(self.data_dir), f"--dataset={self.dataset} needs --data_dir: {needs}")
        require(_MIN_IMAGE_SIZE <= self.image_size <= _MAX_IMAGE_SIZE,
                f"--image_size={self.image_size} must be in [{_MIN_IMAGE_SIZE}, {_MAX_IMAGE_SIZE}]")
        require(0 <= self.test_fraction < 1,
                f"--test_fraction={self.test_fraction} must be in [0, 1)")
        require_positive(self, "synthetic_examples")
        require_at_most(self, MAX_EXAMPLES, "synthetic_examples")

    def load(self, seed: int, splits: Sequence[str] = SPLITS, headroom=None) -> Dataset:
        """The `splits` of this dataset, read as these options say (`seed`:
        the run's, which synthetic data and a held-out test split are drawn
        with); only those splits are read, refused if they would take more
        memory than `headroom` (process/memory.py's; None: unknown)."""
        module, _, function = DATASETS[self.dataset].loader.partition(":")
        return getattr(importlib.import_module(module), function)(self, seed, tuple(splits),
                                                                  headroom)


__all__ = ["DATASETS", "DataOptions", "SPLITS", "Dataset", "DatasetInfo", "DatasetSpec",
           "ImageSplit"]
