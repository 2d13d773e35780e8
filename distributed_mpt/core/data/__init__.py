"""The datasets the package trains on, declared once each in `DATASETS`.

Adding one means a module with a `load(source, splits) -> Dataset` and a
line below (docs/extending.md); --dataset, --help, the checks and predict
take it from here.
"""

from typing import Sequence

from distributed_mpt.core.data import cifar10, image_folder, synthetic
from distributed_mpt.core.data.dataset import (SPLITS, DataSource, Dataset, DatasetInfo,
                                               DatasetSpec, ImageSplit)

DATASETS = {spec.name: spec for spec in (
    DatasetSpec(cifar10.NAME, "CIFAR-10 from its official binary release in --data_dir, or "
                "tensorflow-datasets (downloaded unless --nodownload)", cifar10.load),
    DatasetSpec(synthetic.NAME, "CIFAR-shaped data with learnable labels, made from --seed "
                "(no download)", synthetic.load),
    DatasetSpec(image_folder.NAME, f"your own labelled images in --data_dir: "
                f"{image_folder.LAYOUT}, resized to --image_size", image_folder.load,
                needs_data_dir=True),
)}


def load_dataset(name: str, source: DataSource, splits: Sequence[str] = SPLITS) -> Dataset:
    """The `splits` of dataset `name` (a DATASETS key; KeyError otherwise),
    read as `source` says; only those splits are read."""
    return DATASETS[name].load(source, tuple(splits))


__all__ = ["DATASETS", "SPLITS", "DataSource", "Dataset", "DatasetInfo", "DatasetSpec",
           "ImageSplit", "load_dataset"]
