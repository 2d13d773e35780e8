"""The datasets the package trains on, declared once each in `DATASETS`.

Adding one means a module with a `load(source, splits) -> Dataset` and a
line below (docs/extending.md); --dataset, --help, the checks and predict
take it from here. The loaders are imported only to load.
"""

from typing import Sequence

from distributed_mpt.core.data.dataset import (SPLITS, DataSource, Dataset, DatasetInfo,
                                               DatasetSpec, ImageSplit)

_HERE = "distributed_mpt.core.data"
IMAGE_FOLDER_LAYOUT = "DATA_DIR/train/<class>/<images> and DATA_DIR/test/<class>/<images>"
DATASETS = {spec.name: spec for spec in (
    DatasetSpec("cifar10", "CIFAR-10 from its official binary release in --data_dir, or "
                "tensorflow-datasets (downloaded unless --nodownload)", f"{_HERE}.cifar10:load"),
    DatasetSpec("synthetic", "CIFAR-shaped data with learnable labels, made from --seed "
                "(no download)", f"{_HERE}.synthetic:load"),
    # Not flipped unless asked: a mirrored digit or letter is another sign.
    DatasetSpec("image_folder", f"your own labelled images in --data_dir: {IMAGE_FOLDER_LAYOUT}, "
                f"resized to --image_size", f"{_HERE}.image_folder:load", needs_data_dir=True,
                flip="none"),
)}


def load_dataset(name: str, source: DataSource, splits: Sequence[str] = SPLITS) -> Dataset:
    """The `splits` of dataset `name` (a DATASETS key; KeyError otherwise),
    read as `source` says; only those splits are read."""
    return DATASETS[name].load(source, splits)


__all__ = ["DATASETS", "SPLITS", "DataSource", "Dataset", "DatasetInfo", "DatasetSpec",
           "ImageSplit", "load_dataset"]
