"""docs/extending.md, followed as it reads: the model files it tells users
to save (its Python blocks that open with `# NAME.py`), and its walk, "The
whole way" (train, stop and resume, predict, the cluster), with each model of
the walk's table. Everything is read from the page, so that an edit that
breaks an example fails here; only the run is shortened (a few steps, a
tiny folder of greyscale digits), by flags appended as a user would."""

import re
import shlex
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import REPO, WatchedProcess, assert_ok, read_summary, run_in_process, train
from support.k8s_pods import K8S, VARIANTS, edit, edit_settings, load_check, of_kind, render, training_pods

check = load_check()
PAGE = (REPO / "docs" / "extending.md").read_text()
WALK = PAGE[PAGE.index("## The whole way"):]
WALK = WALK[:WALK.index("\n## ", 1)]
STEPS = 30  # enough steps that a stop after the first lands before the end
SHORTER = [f"--train_steps={STEPS}", "--per_replica_batch_size=8", "--steps_per_loop=1",
           "--log_every_steps=1"]


def page_files() -> dict:
    """{file name: source} of the page's Python blocks that open with
    `# NAME.py` (a block `# NAME.py, continued` is appended to NAME.py)."""
    files = {}
    for block in re.findall(r"^```python\n(.*?)^```", PAGE, re.S | re.M):
        named = re.match(r"# (\w+\.py)\b", block)
        if named:
            files[named.group(1)] = files.get(named.group(1), "") + block
    return files


def walk_commands() -> list:
    """The argument lists of the walk's commands (its first bash block)."""
    block = re.search(r"^```bash\n(.*?)^```", WALK, re.S | re.M).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def walk_flags() -> list:
    """The settings' flags the walk gives for the cluster (its yaml block)."""
    (block,) = re.findall(r"^( *)```yaml\n(.*?)^\1```", WALK, re.S | re.M)
    indent, text = block
    return yaml.safe_load("\n".join(line[len(indent):] for line in text.splitlines()))["flags"]


def walk_models() -> list:
    """(--model value, the file k8s/settings/model needs or None, the flags
    it needs besides) of each row of the walk's table."""
    rows = []
    for line in WALK.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`") and cells[1] != "`--model=`":
            file = cells[2].strip("`") if cells[2].startswith("`") else None
            rows.append((cells[1].strip("`"), file, re.findall(r"`(--\w+=\S+?)`", cells[3])))
    return rows


def with_flags(args, flags) -> list:
    """`args` with each of `flags` replacing the flag of its name, or added."""
    names = {f.split("=", 1)[0] for f in flags}
    return [a for a in args if a.split("=", 1)[0] not in names] + list(flags)


def digits_folder(root: Path) -> None:
    """A tiny stand-in for the page's digits folder, named as its script
    names it (image i of label i % 4 as train/<label>/<i:04d>.png): 8 x 8
    greyscale, each class a bright row of its own."""
    rng = np.random.default_rng(0)
    for i in range(40):
        label = i % 4
        pixels = rng.integers(0, 40, (8, 8), dtype=np.uint8)
        pixels[2 * label:2 * label + 2] += 200
        (root / "train" / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, "L").save(root / "train" / str(label) / f"{i:04d}.png")


def here(args, where: Path) -> list:
    """A walk command's arguments with its relative paths (the model file,
    the folder, the run, the image) under `where`, the user's directory."""
    out = []
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag in ("--data_dir", "--model_dir") or (flag == "--model" and ".py:" in value):
            arg = f"{flag}={where / value}"
        elif not arg.startswith("-"):
            arg = str(where / arg)
        out.append(arg)
    return out


def test_the_page_holds_what_the_walk_uses():
    files, models = page_files(), walk_models()
    assert {"my_models.py", "mobilenet.py"} <= files.keys()
    assert [m for m, _, _ in models] == ["my_models.py:small_cnn", "my_models.py:tiny_resnet",
                                         "mobilenet.py:mobilenet", "airbench"]
    assert all(file in files for _, file, _ in models if file)
    assert [c[0] for c in walk_commands()] == ["distributed-mpt-train", "distributed-mpt-predict"]
    assert "class TinyResNet(keras.Model)" in files["my_models.py"]


def test_the_page_undoes_every_mirror_image_a_recipe_sets():
    """Digits and text must not be mirrored: where a recipe flips in training
    or at test time, the page's "Flips" says which flags undo it, and the
    walk's settings carry them after the recipe."""
    from distributed_mpt import recipes
    flips = PAGE[PAGE.index("**Flips.**"):]
    flips = " ".join(flips[:flips.index("\n\n")].split())
    named = re.findall(r"`--recipe=(\w+)`", flips)
    assert named
    for name in named:
        recipe = Path(recipes.path(name)).read_text()
        mirrors = re.findall(r"^--(flip|eval_tta)=(\w+)$", recipe, re.M)
        undo = {f"--{flag}=none" for flag, value in mirrors if value != "none" and
                (flag == "flip" or "flip" in value)}
        assert undo and all(u in flips for u in undo), (name, undo)
    assert {"--flip=none", "--eval_tta=none"} <= set(walk_flags())


@pytest.mark.parametrize("model, file, besides", [row for row in walk_models() if row[1]],
                         ids=[m for m, file, _ in walk_models() if file])
def test_each_model_file_of_the_page_meets_the_contract(model, file, besides, tmp_path):
    """The quick look: each file's function builds a model that takes the
    walk's uint8 images and returns logits, checked as a run checks it, and
    one the export can save."""
    from distributed_mpt.core import models
    from distributed_mpt.core.data.dataset import DatasetInfo
    from distributed_mpt.training import build

    (tmp_path / file).write_text(page_files()[file])
    size = int(next((f for f in besides if f.startswith("--image_size=")), "=16").partition("=")[2])
    info = DatasetInfo((size, size, 3), ("0", "1", "2", "3"), (40.0,) * 3, (60.0,) * 3)
    source = f"{tmp_path / file}:{model.partition(':')[2]}"
    built = models.build_model(models.model_spec(source), info)
    build.check_exportable(built, source)
    logits = np.asarray(built(np.zeros((2, size, size, 3), np.uint8), training=False))
    assert logits.shape == (2, 4) and np.all(np.isfinite(logits))


def _walk_rows():
    """Each row of the walk's table; the subclassed model's in the fast tier
    (the one the export could not save before), the others slow: each stops
    a training process and resumes it (about 40 s each on 2 cores, 100-160 s
    on a loaded machine)."""
    return [pytest.param(*row, id=row[0], marks=() if row[0].endswith(":tiny_resnet") else pytest.mark.slow)
            for row in walk_models()]


@pytest.mark.parametrize("model, file, besides", _walk_rows())
def test_each_model_trains_resumes_and_predicts_as_the_walk_says(model, file, besides, tmp_path):
    for name, source in page_files().items():
        (tmp_path / name).write_text(source)
    digits_folder(tmp_path / "digits")
    train_args, predict_args = [c[1:] for c in walk_commands()]
    args = here(with_flags(train_args, [f"--model={model}"]), tmp_path)
    args = with_flags(args, [*besides, *SHORTER] + (["--model_width=4"] if ".py:" not in model else []))
    model_dir = Path(next(a for a in args if a.startswith("--model_dir=")).partition("=")[2])

    # Stopped after its first step, as Ctrl-C or a scheduler stops it ...
    run = WatchedProcess("distributed_mpt.train", args)
    run.wait_for(rf"^step +\d+/{STEPS}", timeout=600)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == 143, run.output()[-3000:]
    import tensorflow as tf
    stopped_at = int(tf.train.latest_checkpoint(str(model_dir / "checkpoints")).rpartition("-")[2])
    assert 0 < stopped_at < STEPS
    # ... the same command again continues at that step, to the end.
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert_ok(train(args))
    summary = read_summary(model_dir)
    assert (summary["resumed_from_step"], summary["steps"]) == (stopped_at, STEPS)
    # Keras' UserWarning, a line of another format on stderr: the export
    # gives a subclassed model its input, and saves it built.
    assert not [w for w in warned if "not yet been built" in str(w.message)]

    from distributed_mpt.predict import main
    answer = run_in_process(main, here(predict_args, tmp_path))
    assert_ok(answer)
    image = Path(here(predict_args, tmp_path)[-1])
    (line,) = answer.stdout.splitlines()
    found = re.fullmatch(rf"{re.escape(str(image))}: (\S+) (0\.\d+|1\.0+)", line)
    assert found and found.group(1) in {"0", "1", "2", "3"}, line
    if model.endswith(":tiny_resnet"):
        # As the page says: Keras loads model.keras given the class.
        import importlib.util

        import keras
        spec = importlib.util.spec_from_file_location("page_models", tmp_path / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded = keras.models.load_model(model_dir / "export" / "model.keras",
                                         custom_objects={"TinyResNet": module.TinyResNet})
        probabilities = np.asarray(loaded(np.zeros((2, 16, 16, 3), np.uint8)))
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("model, file, besides", walk_models(), ids=[m for m, _, _ in walk_models()])
def test_each_model_renders_for_the_cluster_as_the_walk_says(model, file, besides, tmp_path):
    """The walk's step 4 on a copy of k8s/: the page's file in
    k8s/settings/model, listed; the walk's flags in the settings (on CPUs,
    the image pinned: what any job needs). k8s/check.py's verdict on every
    variant is clean, and each pod's command ends with the flags, its
    --model a file of the ConfigMap mounted at /models."""
    k8s = Path(shutil.copytree(K8S, tmp_path / "k8s"))
    if file:
        (k8s / "settings" / "model" / file).write_text(page_files()[file])
        if file != "model.py":
            edit(k8s / "settings" / "model" / "kustomization.yaml",
                 {"  - model.py\n": f"  - model.py\n  - {file}\n"})
    flags = [f"--model=/models/{model}" if f.startswith("--model=") and ".py:" in model
             else f"--model={model}" if f.startswith("--model=") else f for f in walk_flags()]
    flags = with_flags(flags, besides)
    edit_settings(k8s, recipe="cpu_cnn", precision="float32", communication="ring", flags=flags)
    edit(k8s / "settings" / "kustomization.yaml", {"sha256:" + "0" * 64: "sha256:" + "ab" * 32,
                                                   "registry.example.com/": "registry.internal/"})
    found = check.check(k8s, VARIANTS)
    assert found.errors == [], found.errors
    for variant in VARIANTS:
        docs = render(variant, k8s)
        (configmap,) = of_kind(docs, "ConfigMap")
        if file:
            assert configmap["data"][file] == page_files()[file]
        for pod in training_pods(docs):
            assert pod.command[-len(flags):] == flags, variant
