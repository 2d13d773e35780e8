"""Strategy names resolve by what the process finds; see test_train.py and
test_multi_worker.py for the strategies at work in real processes."""

import pytest
import tensorflow as tf

from distributed_mpt.cluster import resolve_cluster
from distributed_mpt.distribution import resolve_strategy_name
from distributed_mpt.errors import ConfigError

TWO_WORKERS = resolve_cluster({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, '
                                            '"task": {"type": "worker", "index": 0}}'})
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize("name, cluster, cpu_replicas, expected", [
    ("auto", TWO_WORKERS, 0, "multi_worker"),
    ("auto", None, 2, "mirrored"),
    ("auto", None, 0, "one_device" if HAS_GPU else "default"),
    ("mirrored", None, 0, "mirrored"),
    ("one_device", None, 0, "one_device"),
    ("multi_worker", TWO_WORKERS, 0, "multi_worker"),
])
def test_resolve_strategy_name(name, cluster, cpu_replicas, expected):
    assert resolve_strategy_name(name, cluster, cpu_replicas) == expected


def test_multi_worker_without_a_cluster_says_how_to_get_one():
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        resolve_strategy_name("multi_worker", None, 0)


def test_a_single_worker_strategy_under_a_multi_worker_cluster_is_refused():
    with pytest.raises(ConfigError, match="separate models"):
        resolve_strategy_name("mirrored", TWO_WORKERS, 0)
