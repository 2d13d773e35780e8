"""The real training entry point, with tensorflow-datasets' mock_data standing
in for the CIFAR-10 download (tests only: there is no network in CI)."""

import sys
from unittest import mock

import tensorflow_datasets as tfds

from distributed_mpt import train

if __name__ == "__main__":
    num_examples = int(sys.argv[1])
    # mock_data serves fake splits but does not mark the dataset prepared.
    with tfds.testing.mock_data(num_examples=num_examples), \
            mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True):
        sys.exit(train.main(sys.argv[2:]))
