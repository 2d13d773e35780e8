"""Flags become a validated config; bad values are one clear ConfigError."""

import pytest

from distributed_mpt.errors import ConfigError
from distributed_mpt.train import parse_config


def test_flags_become_config(tmp_path):
    config = parse_config([f"--model_dir={tmp_path}", "--model=mlp", "--precision=mixed_bfloat16",
                           "--per_replica_batch_size=64", "--nodownload", "--train_steps=7"])
    assert (config.model, config.precision, config.per_replica_batch_size) == ("mlp", "mixed_bfloat16", 64)
    assert config.download is False and config.train_steps == 7
    assert config.strategy == "auto" and config.dataset == "cifar10"


def test_flagfile(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("# a recipe\n--model=mlp\n--epochs=3\n")
    config = parse_config([f"--flagfile={flagfile}", f"--model_dir={tmp_path}"])
    assert (config.model, config.epochs) == ("mlp", 3)


def test_shipped_recipes_parse(tmp_path):
    from importlib import resources

    recipes = resources.files("distributed_mpt") / "recipes"
    names = sorted(p.name for p in recipes.iterdir() if p.name.endswith(".flags"))
    assert names == ["mlp.flags", "resnet9.flags"]
    for name in names:
        text = (recipes / name).read_text()
        assert "accuracy" in text.lower(), f"{name} must say what accuracy it reaches"
        parse_config([f"--flagfile={recipes / name}", f"--model_dir={tmp_path}"])


@pytest.mark.parametrize("argv, fragment", [
    (["--per_replica_batch_size=0"], "per_replica_batch_size"),
    (["--per_replica_batch_size=-8"], "per_replica_batch_size"),
    (["--per_replica_batch_size=many"], "per_replica_batch_size"),
    (["--model=vgg"], "model"),
    (["--precision=float16"], "precision"),
    (["--strategy=parameter_server"], "strategy"),
    (["--strategy=one_device", "--cpu_replicas=2"], "cpu_replicas"),
    (["--strategy=multi_worker", "--cpu_replicas=2"], "cpu_replicas"),
    (["--learning_rate=0"], "learning_rate"),
    (["--epochs=0"], "epochs"),
    (["--no_such_flag=1"], "no_such_flag"),
    (["positional"], "positional"),
])
def test_bad_values_raise_one_line(tmp_path, argv, fragment):
    with pytest.raises(ConfigError) as error:
        parse_config([f"--model_dir={tmp_path}", *argv])
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_model_dir_required():
    with pytest.raises(ConfigError, match="model_dir"):
        parse_config([])


@pytest.mark.parametrize("seed", ["-1", str(2**31)])
def test_seed_out_of_range(tmp_path, seed):
    with pytest.raises(ConfigError, match="seed"):
        parse_config([f"--model_dir={tmp_path}", f"--seed={seed}"])
