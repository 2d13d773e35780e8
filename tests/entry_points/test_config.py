"""Flags become a validated config; bad values are one clear ConfigError."""

import json

import pytest

from conftest import SMOKE_FLAGS, assert_ok, assert_one_error_line, read_summary, train
from distributed_mpt.errors import ConfigError
from distributed_mpt.train import parse_config


def test_flags_become_config(tmp_path):
    config = parse_config([f"--model_dir={tmp_path}", "--model=mlp", "--precision=mixed_bfloat16",
                           "--per_replica_batch_size=64", "--nodownload", "--train_steps=7"])
    assert (config.model.model, config.run.precision, config.run.per_replica_batch_size) == ("mlp", "mixed_bfloat16", 64)
    assert config.data.download is False and config.schedule.train_steps == 7
    assert config.cluster.strategy == "auto" and config.data.dataset == "cifar10"


def test_flagfile(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("# a recipe\n--model=mlp\n--epochs=3\n")
    config = parse_config([f"--flagfile={flagfile}", f"--model_dir={tmp_path}"])
    assert (config.model.model, config.schedule.epochs) == ("mlp", 3)


def test_a_tilde_in_a_path_flag_is_the_home_directory(tmp_path, monkeypatch):
    # No shell expands it after `=`: a directory named `~` would appear here.
    monkeypatch.setenv("HOME", str(tmp_path))
    config = parse_config(["--model_dir=~/runs/a", "--data_dir=~/data"])
    assert (config.run.model_dir, config.data.data_dir) == (f"{tmp_path}/runs/a", f"{tmp_path}/data")


def test_shipped_recipes_parse(tmp_path):
    from importlib import resources

    recipes = resources.files("distributed_mpt") / "recipes"
    names = sorted(p.name for p in recipes.iterdir() if p.name.endswith(".flags"))
    assert names == ["cpu_cnn.flags", "cpu_cnn94.flags", "cpu_cnn94_muon.flags", "mlp.flags",
                     "resnet9.flags"]
    for name in names:
        text = (recipes / name).read_text()
        assert "accuracy" in text.lower(), f"{name} must say what accuracy it reaches"
        parse_config([f"--flagfile={recipes / name}", f"--model_dir={tmp_path}"])


@pytest.mark.parametrize("argv, said", [
    (["--recipe=cpu_cnn94", "--model=mlp"], "warning: this run ignores --shift_lr_multiplier=64.0, "
     "--whiten_bias_epochs=3.0: --model=mlp has no part they act on"),
    (["--model=resnet9", "--model_width=4", "--activation=silu"],
     "warning: this run ignores --activation=silu: --model=resnet9 has no part they act on")])
def test_flags_the_chosen_model_ignores_are_named_in_one_warning(model_dir, argv, said):
    # A recipe tuned for airbench, run with another --model (an experiment),
    # trained without a word, its airbench-only flags kept; so did a flag of
    # airbench's given for another network.
    result = train([*argv, "--dataset=synthetic", "--synthetic_examples=64",
                    "--per_replica_batch_size=16", "--train_steps=1", "--noexport",
                    f"--model_dir={model_dir}"])
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if "ignores" in line]
    assert warnings == [said], result.stderr[-2000:]


@pytest.mark.parametrize("argv, ignored", [
    (["--recipe=cpu_cnn94_muon", "--model=resnet9"],
     "--bn_momentum=0.5566, --whiten_images=960, --whiten_bias_epochs=0.22, "
     "--whiten_bias_freeze=stop: --model=resnet9"),
    (["--recipe=cpu_cnn94_muon", "--model=mlp", "--optimizer=sgd"],
     "--muon_newton_schulz=speedrun2025: they are --optimizer=muon's"),
    (["--model=my_model.py:build", "--model_width=8", "--whiten_bias_epochs=2"],
     "ignores --model_width=8: --model=my_model.py:build has"),  # its layers may whiten
    *[([f"--recipe={name}"], "") for name in ("cpu_cnn", "cpu_cnn94", "cpu_cnn94_muon", "mlp",
                                                "resnet9")]])
def test_what_each_model_ignores(tmp_path, argv, ignored):
    said = parse_config([*argv, f"--model_dir={tmp_path}"]).ignored_flags()
    assert (ignored in said) if ignored else said == "", said


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
    (["--epochs=nan"], "--epochs=nan: nan is not a decimal number"),
    (["--no_such_flag=1"], "no_such_flag"),
    (["positional"], "positional"),
    # Absurd numbers: refused before anything runs, not a traceback hours later.
    (["--learning_rate=inf"], "--learning_rate=inf: inf is not a decimal number"),
    (["--warmup_epochs=inf"], "--warmup_epochs=inf: inf is not a decimal number"),
    (["--weight_decay=nan"], "--weight_decay=nan: nan is not a decimal number"),
    # Numbers are ASCII decimals: what Python's int() and float() also take is not.
    (["--train_steps=0x10"], "--train_steps=0x10: 0x10 is not a whole number in decimal digits"),
    (["--train_steps=1_000"], "--train_steps=1_000: 1_000 is not a whole number"),
    (["--seed=\u0661\u0662"], "is not a whole number in decimal digits"),
    (["--learning_rate=1_0.5"], "--learning_rate=1_0.5: 1_0.5 is not a decimal number"),
    # An unset shell variable, and a word for a switch: said as such, not as
    # "--epochs=:  is not" and "('Non-boolean argument to boolean flag', 'yes')".
    (["--epochs="], "flag --epochs=: an empty value is not a decimal number"),
    (["--train_steps= "], "flag --train_steps= : an empty value is not a whole number"),
    (["--export=yes"], "flag --export=yes: 'yes' is neither true nor false"),
    (["--train_steps=1000000000000000000000000000000"], "train_steps"),
    (["--synthetic_examples=1000000000000"], "--synthetic_examples=1000000000000 is larger"),
    (["--model_width=1000000000"], "--model_width=1000000000 is larger"),
    (["--cpu_replicas=100000"], "--cpu_replicas=100000 is larger"),
    (["--recipe=nope"], "--recipe=nope is not one of the shipped recipes"),
    (["--recipe=cpu_cnn", "--recipe", "mlp"], "--recipe given 2 times (cpu_cnn, mlp): one recipe"),
    (["--seed=-1"], "seed"),
    # The 2025 record's options (tests/core/test_record2025.py).
    (["--muon_weight_decay=-0.1"], "--muon_weight_decay=-0.1 must be >= 0"),
    (["--muon_weight_decay=inf"], "--muon_weight_decay=inf: inf is not a decimal number"),
    (["--muon_renormalize=sometimes"], "--muon_renormalize=sometimes: value should be one of <every_step|periodic>"),
    (["--muon_newton_schulz=exact"], "--muon_newton_schulz=exact: value should be one of <airbench|speedrun2025>"),
    (["--brightness_jitter=-0.1"], "--brightness_jitter=-0.1 must be in [0, 10]"),
    (["--brightness_jitter=11"], "--brightness_jitter=11.0 must be in [0, 10]"),
    (["--contrast_jitter=1"], "--contrast_jitter=1.0 must be in [0, 1)"),
    (["--contrast_jitter=-0.5"], "--contrast_jitter=-0.5 must be in [0, 1)"),
    (["--eval_tta_fraction=0"], "--eval_tta_fraction=0.0 must be in (0, 1]"),
    (["--eval_tta_fraction=1.5"], "--eval_tta_fraction=1.5 must be in (0, 1]"),
    (["--eval_tta=flip_translate_median"], "--eval_tta=flip_translate_median: value should be one of <none|flip|flip_translate|flip_translate_mean>"),
    ([f"--seed={2**31}"], "seed"),
    # Finite, but what a run derives from them would not be (steps, rates,
    # a deadline): each bounded, the bound said.
    (["--warmup_epochs=1e308"], "--warmup_epochs=1e+308 is larger than this program accepts"),
    (["--whiten_bias_epochs=1e308"], "--whiten_bias_epochs=1e+308 is larger than this program"),
    (["--learning_rate=1e400"], "--learning_rate=1e400: 1e400 is too large for a number"),
    (["--max_learning_rate=1e300"], "--max_learning_rate=1e+300 is larger than this program"),
    (["--weight_decay=1e300"], "--weight_decay=1e+300 is larger than this program accepts"),
    (["--muon_weight_decay=1e300"], "--muon_weight_decay=1e+300 is larger than this program"),
    (["--shift_lr_multiplier=1e-300"], "--shift_lr_multiplier=1e-300 must be in [0.0001, 10000]"),
    (["--peer_timeout_seconds=99999999999999999999"], "--peer_timeout_seconds=99999999999999999999 "
                                                      "is larger than this program accepts (604,800)"),
    (["--steps_per_loop=99999999999999999999"], "--steps_per_loop=99999999999999999999 is larger"),
    (["--eval_every_epochs=99999999999999999999"], "--eval_every_epochs=99999999999999999999 is"),
])
def test_bad_values_raise_one_line(tmp_path, argv, fragment):
    with pytest.raises(ConfigError) as error:
        parse_config([f"--model_dir={tmp_path / 'run'}", *argv])
    assert fragment in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists(), "nothing is created"


@pytest.mark.parametrize("field, value, fragment", [
    ("learning_rate", float("inf"), "--learning_rate=inf must be a finite number"),
    ("warmup_epochs", float("inf"), "--warmup_epochs=inf must be a finite number"),
    ("weight_decay", float("nan"), "--weight_decay=nan must be a finite number"),
    ("epochs", float("nan"), "--epochs=nan must be a finite number"),
    ("max_learning_rate", float("inf"), "--max_learning_rate=inf must be a finite number"),
    ("test_fraction", float("nan"), "--test_fraction=nan must be a finite number"),
])
def test_a_config_not_from_flags_is_validated_alike(field, value, fragment):
    """What a config.json read back holds (predict rebuilds a model from
    it) passes no flag parser: the config checks every number itself."""
    from distributed_mpt.config import TrainConfig

    with pytest.raises(ConfigError) as error:
        TrainConfig.from_flags(model_dir="x", **{field: value})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_model_dir_required():
    with pytest.raises(ConfigError, match="model_dir"):
        parse_config([])


def test_each_model_gets_its_own_defaults_unless_a_flag_is_given(tmp_path):
    from distributed_mpt.core.models import MODELS

    assert {"mlp", "resnet9", "airbench"} <= set(MODELS)
    for model, spec in MODELS.items():
        defaults = spec.defaults.values()
        assert set(defaults) == {"learning_rate", "max_learning_rate", "warmup_epochs",
                                 "momentum", "weight_decay", "label_smoothing"}
        config = parse_config([f"--model_dir={tmp_path}", f"--model={model}"])
        assert {name: config.flags()[name] for name in defaults} == defaults
    config = parse_config([f"--model_dir={tmp_path}", "--model=mlp", "--learning_rate=0.3",
                           "--weight_decay=0.001"])
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (0.3, 0.001)
    assert config.schedule.warmup_epochs == MODELS["mlp"].defaults.warmup_epochs


def test_help_names_each_models_default(capsys):
    from distributed_mpt.train import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # absl wraps the help
    assert "Default per model: mlp 0.05, resnet9 0.1, airbench 0.1875" in text
    assert "at most half" in text, "the warmup cap is stated"


def test_workers_must_agree_on_every_flag_that_changes_the_run(tmp_path):
    from distributed_mpt.config import shared_flags

    config = parse_config([f"--model_dir={tmp_path}", "--model=mlp"])
    shared = shared_flags(config)
    assert {"seed", "weight_decay", "label_smoothing", "learning_rate", "per_replica_batch_size",
            "model", "epochs", "steps_per_loop"} <= set(shared)
    assert shared["learning_rate"] == 0.05, "the per-model default, as resolved"
    # Where each worker finds its files, and what each resolves from `auto`.
    assert not {"model_dir", "data_dir", "download", "precision", "strategy"} & set(shared)


@pytest.mark.parametrize("args, fragment", [
    (["--nodownload=1"], "--nodownload=1 does not take an argument"),
    (["--recipe=../../etc/x"], "not one of the shipped recipes"),
    (["--recipe", "../mlp"], "not one of the shipped recipes"),
])
def test_flag_syntax_errors_are_one_config_error(tmp_path, args, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_config([*args, f"--model_dir={tmp_path}"])


def test_a_nested_flagfile_that_is_a_fifo_is_refused_unread(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    outer = tmp_path / "outer.flags"
    outer.write_text(f"--model=mlp\n--flagfile={tmp_path / 'fifo'}\n")
    with pytest.raises(ConfigError, match="fifo is a FIFO, not a regular file"):
        parse_config([f"--flagfile={outer}", f"--model_dir={tmp_path}"])


def test_a_missing_model_dir_is_said_first():
    # As before the settings were in sections: what a user most often leaves
    # out is named before any other mistake of the same command line.
    from distributed_mpt.config import TrainConfig

    with pytest.raises(ConfigError, match="--model_dir is required"):
        TrainConfig.from_flags(dataset="image_folder", learning_rate=-1.0, epochs=-2)


def test_a_dataset_that_needs_a_data_dir_says_what_it_must_hold():
    # Declared once, by the dataset (DatasetSpec.needs_data_dir), not special-cased by name.
    with pytest.raises(ConfigError) as error:
        parse_config(["--dataset=image_folder", "--model_dir=unused"])
    assert str(error.value) == ("--dataset=image_folder needs --data_dir: the folder of class "
                                "folders (DATA_DIR/train/<class>/<images>)")
    parse_config(["--dataset=synthetic", "--model_dir=unused"])  # made from --seed: none needed


def _newer(section: dict, top: dict):
    """config.json as a newer version would write it: settings this one lacks."""
    def edit(record):
        return {**record, **top, "optimizer": {**record["optimizer"], **section}}
    return edit


@pytest.mark.parametrize("edit, said", [
    (_newer({"gradient_clip_norm": 0.5}, {"mixup_alpha": 0.4}),
     "(mixup_alpha, optimizer.gradient_clip_norm): it was likely written by a newer"),
    (_newer({}, {"mixup_alpha": 0.4}), "(mixup_alpha)"),
], ids=["in a section and at the top", "at the top"])
def test_a_resume_of_a_newer_versions_run_is_refused_naming_what_it_lacks(model_dir, edit, said):
    """Resumed without them, the run trained on without its clipping, and
    only the 'earlier' record of the new config.json kept a trace."""
    flags = [*SMOKE_FLAGS, "--noevaluate", "--checkpoint_every_steps=2", f"--model_dir={model_dir}"]
    assert_ok(train([*flags, "--train_steps=2"]))
    config = model_dir / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    written = config.read_bytes()
    result = train([*flags, "--train_steps=4"])
    assert_one_error_line(result, f"{config} records settings this version does not know {said}")
    assert config.read_bytes() == written and read_summary(model_dir)["steps"] == 2
