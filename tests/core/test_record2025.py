"""The parts of the 2025 record (hiverge/cifar10-speedrun) brought over as
options: each does the record's arithmetic (checked against NumPy), touches
only what it names, and keeps the loop's promises (N replicas = 1 replica,
a step-exact resume)."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (RECORD, assert_one_error_line, assert_same_weights, group_settings,
                      read_summary, train, weights_of_one_and_two_replicas,
                      weights_of_whole_and_resumed)

from distributed_mpt.core.optim import groups
from distributed_mpt.core.optim.optimizer import GroupedOptimizer
from distributed_mpt.core.optim.rules import (NEWTON_SCHULZ, Muon, NesterovSGD, orthogonalize,
                                              periodic_renormalization)


def _record_renormalizations(total: int) -> list:
    """The record's Muon.step bookkeeping, written out as it has it."""
    step_count, last_norm_step, due = 0, 0, []
    for _ in range(total):
        step_count += 1
        norm_freq = 2 + int(15 * (step_count / total))
        renormalize = step_count - last_norm_step >= norm_freq
        if renormalize:
            last_norm_step = step_count
        due.append(renormalize)
    return due


def test_periodic_renormalization_is_the_2025_records_schedule():
    for total in (1, 2, 7, 200, 243, 1000):
        assert periodic_renormalization(total) == _record_renormalizations(total), total
    steps = [i for i, due in enumerate(periodic_renormalization(243)) if due]
    assert steps[:3] == [1, 3, 5], "every second step at first (steps counted from 0)"
    gaps = np.diff(steps)
    assert gaps[0] == 2 and gaps[-1] == 16
    # The gap asked for grows to 2 + 15 = 17 at the last step; the run ends
    # 13 steps after its last renormalization, before the next is due.
    assert steps[-1] == 229


def _kernel_and_gradient():
    rng = np.random.default_rng(1)
    kernel = rng.normal(size=(3, 3, 4, 8)).astype(np.float32)
    gradient = rng.normal(size=(3, 3, 4, 8)).astype(np.float32)
    return kernel, gradient


def _newton_schulz(matrix, coefficients, steps=3):
    """Newton-Schulz in NumPy: X <- a X + (b A + c A^2) X, A = X X^T, on the
    wide orientation."""
    a, b, c = coefficients
    x = matrix.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / np.linalg.norm(x)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("name", list(NEWTON_SCHULZ))
def test_newton_schulz_iterates_with_the_coefficients_named(name):
    assert list(NEWTON_SCHULZ) == ["airbench", "speedrun2025"]
    matrix = np.random.default_rng(3).normal(size=(8, 20))
    for shape in (matrix, matrix.T):  # the tall one through its transpose
        got = orthogonalize(tf.constant(shape, tf.float32), coefficients=NEWTON_SCHULZ[name])
        np.testing.assert_allclose(got.numpy(), _newton_schulz(shape, NEWTON_SCHULZ[name]),
                                   rtol=1e-4, atol=1e-5)
    other = NEWTON_SCHULZ["speedrun2025" if name == "airbench" else "airbench"]
    assert np.abs(_newton_schulz(matrix, other) - _newton_schulz(matrix, NEWTON_SCHULZ[name])
                  ).max() > 1e-3, "the coefficients make a difference"


@pytest.mark.parametrize("step, table", [(0, [True, False]), (1, [True, False]),
                                         (5, [False, True]), (0, None)])
def test_a_muon_step_renormalizes_when_its_table_says_and_decays_after_the_step(step, table):
    # The table is read at the run's step (past its end: its last entry);
    # None renormalizes every step. Then (w - rate x update) x (1 - rate x
    # lambda), rate = the group's 0.2 x the run's 0.5.
    start, gradient = _kernel_and_gradient()
    kernel = keras.Variable(start)
    rule = Muon(0.6, weight_decay=0.3, renormalize_steps=table,
                coefficients=NEWTON_SCHULZ["speedrun2025"])
    optimizer = GroupedOptimizer([groups.ParameterGroup("filters", (kernel,), rule, rate=0.2)],
                                 lambda s: 0.5, tf.Variable(step, dtype=tf.int64))
    optimizer.apply_gradients([(tf.constant(gradient), kernel)])
    due = table is None or table[min(step, len(table) - 1)]
    rate = 0.2 * 0.5
    # First step: momentum = gradient, Nesterov direction = 1.6 x gradient.
    update = _newton_schulz(1.6 * gradient.reshape(-1, 8), NEWTON_SCHULZ["speedrun2025"])
    scaled = start * np.sqrt(8) / np.linalg.norm(start) if due else start
    want = (scaled - rate * update.reshape(start.shape)) * (1 - rate * 0.3)
    np.testing.assert_allclose(kernel.numpy(), want, rtol=1e-4, atol=1e-5)


def test_without_the_records_options_a_muon_step_is_airbench94_muons():
    start, gradient = _kernel_and_gradient()
    kernel = keras.Variable(start)
    optimizer = GroupedOptimizer([groups.ParameterGroup("filters", (kernel,), Muon(0.6), rate=0.2)],
                                 lambda s: 0.5, tf.Variable(3, dtype=tf.int64))
    optimizer.apply_gradients([(tf.constant(gradient), kernel)])
    update = _newton_schulz(1.6 * gradient.reshape(-1, 8), NEWTON_SCHULZ["airbench"])
    want = start * np.sqrt(8) / np.linalg.norm(start) - 0.1 * update.reshape(start.shape)
    np.testing.assert_allclose(kernel.numpy(), want, rtol=1e-4, atol=1e-5)


def test_the_settings_reach_the_filters_rule_and_only_it():
    from distributed_mpt.core import models
    from distributed_mpt.core.data import cifar10

    model = models.build_model(models.model_spec("airbench"), cifar10.INFO, 8)
    settings = group_settings(0.5, weight_decay=0.1, momentum=0.9, optimizer="muon",
                              muon_learning_rate=0.2, muon_momentum=0.6, momentum_form="pytorch",
                              whiten_bias_epochs=3, muon_weight_decay=0.05,
                              muon_renormalize="periodic", muon_newton_schulz="speedrun2025",
                              total_steps=30)
    made = {group.name: group for group in groups.parameter_groups(model, settings)}
    rule = made["filters"].rule
    assert isinstance(rule, Muon) and rule.momentum == 0.6 and rule.weight_decay == 0.05
    assert rule.coefficients == NEWTON_SCHULZ["speedrun2025"]
    assert list(rule.renormalize_steps) == periodic_renormalization(30)
    assert made["filters"].weight_decay == 0.0
    for name in ("whitening bias", "shifts", "kernels"):
        assert isinstance(made[name].rule, NesterovSGD) and made[name].rule.form == "pytorch"
    plain = groups.parameter_groups(model, group_settings(0.5, weight_decay=0.1, momentum=0.9,
                                                          optimizer="muon"))
    rule = plain[1].rule
    assert (rule.weight_decay, rule.renormalize_steps, rule.coefficients) == (
        0.0, None, NEWTON_SCHULZ["airbench"])


def test_color_jitter_shifts_then_scales_the_normalized_image():
    from distributed_mpt.core import pipeline

    normalized = np.random.default_rng(0).normal(size=(2, 4, 4, 3)).astype(np.float32)
    jitter = np.array([[0.1, 1.1], [-0.2, 0.9]], np.float32)
    got = pipeline.jitter_colors(tf.constant(normalized), tf.constant(jitter)).numpy()
    want = (normalized + jitter[:, 0, None, None, None]) * jitter[:, 1, None, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _jitter_of_each_image(pipelines=1, seed=5, epochs=2, count=64, batch=16, on_device=False,
                          **augmentation):
    """{(epoch, image): (brightness, contrast)} over `epochs`, read from
    `pipelines` input pipelines; each image is its own label (or index)."""
    from distributed_mpt.core import pipeline
    from distributed_mpt.core.augmentation import Augmentation
    from distributed_mpt.core.data import ImageSplit

    split = ImageSplit(np.zeros((count, 32, 32, 3), np.uint8), np.arange(count, dtype=np.int32))
    dataset_fn = pipeline.train_input_fn(
        split, global_batch_size=batch, seed=seed, start_step=0,
        num_steps=epochs * count // batch, images_on_device=on_device,
        augmentation=Augmentation(0, "none", **{f"{name}_jitter": value
                                                for name, value in augmentation.items()}))
    seen = {}
    for index in range(pipelines):
        context = tf.distribute.InputContext(pipelines, index, pipelines)
        for step, parts in enumerate(dataset_fn(context)):
            assert len(parts) == (4 if on_device else 3), "the batch, then the jitter"
            assert parts[-1].dtype == tf.float32 and parts[-1].shape[1:] == [2]
            for image, values in zip(parts[0 if on_device else 1].numpy(), parts[-1].numpy()):
                seen[(step // (count // batch), image)] = tuple(values)
    return seen


def test_color_jitter_is_drawn_per_image_per_epoch_from_the_seed_alone():
    one = _jitter_of_each_image(brightness=0.14, contrast=0.13)
    assert len(one) == 2 * 64
    assert one == _jitter_of_each_image(brightness=0.14, contrast=0.13), "deterministic"
    assert one == _jitter_of_each_image(2, brightness=0.14, contrast=0.13), "however split"
    assert one == _jitter_of_each_image(on_device=True, brightness=0.14, contrast=0.13)
    assert one != _jitter_of_each_image(seed=6, brightness=0.14, contrast=0.13)
    brightness, contrast = np.array(list(one.values())).T
    assert 0.07 < np.abs(brightness).max() <= 0.14
    assert 0.06 < np.abs(contrast - 1).max() <= 0.13
    assert all(one[(0, i)] != one[(1, i)] for i in range(64)), "drawn anew each epoch"
    only_contrast = np.array(list(_jitter_of_each_image(contrast=0.13).values()))
    assert not only_contrast[:, 0].any() and only_contrast[:, 1].std() > 0


@pytest.mark.parametrize("on_device", [False, True])
def test_without_jitter_the_batches_are_what_they_were(on_device):
    from distributed_mpt.core import pipeline
    from distributed_mpt.core.augmentation import Augmentation
    from distributed_mpt.core.data import ImageSplit

    split = ImageSplit(np.zeros((32, 32, 32, 3), np.uint8), np.zeros(32, np.int32))
    plain = pipeline.train_input_fn(split, 16, seed=0, start_step=0, num_steps=1,
                                    images_on_device=on_device, augmentation=Augmentation(flip="random"))
    assert len(next(iter(plain(tf.distribute.InputContext())))) == (3 if on_device else 2)


def test_flip_translate_mean_weighs_airbench94s_six_views_alike():
    from distributed_mpt.core import eval_views

    images = tf.constant(np.random.default_rng(0).integers(0, 256, (4, 6, 6, 3)), tf.uint8)
    six = eval_views.views_of(images, "flip_translate")
    mean = eval_views.views_of(images, "flip_translate_mean")
    np.testing.assert_allclose([w for w, _ in mean], [1 / 6] * 6)
    assert len(mean) == len(six) == 6
    for (_, view), (_, want) in zip(mean, six):
        np.testing.assert_array_equal(view, want)


def _tiny_airbench():
    from distributed_mpt.core import models
    from distributed_mpt.core.data import cifar10

    keras.utils.set_random_seed(0)  # the same weights in every call
    return models.build_model(models.model_spec("airbench"), cifar10.INFO, 8)


def test_the_jitter_goes_in_between_the_normalization_and_the_rest_of_the_same_model():
    from distributed_mpt.core import models, pipeline

    model = _tiny_airbench()
    normalize, rest = models.split_at_normalization(model, "airbench")
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3)).astype(np.uint8)
    # No jitter (b = 0, c = 1): the model itself.
    identity = tf.constant([[0.0, 1.0]] * 3)
    np.testing.assert_allclose(rest(pipeline.jitter_colors(normalize(images), identity)),
                               model(images), rtol=1e-5, atol=1e-5)
    assert {id(v) for v in rest.trainable_variables} == {id(v) for v in model.trainable_variables}
    # A jitter is the model on the jittered normalized images.
    jitter = np.array([[0.3, 1.1], [-0.2, 0.9], [0.0, 1.05]], np.float32)
    normalized = normalize(images).numpy()
    jittered = (normalized + jitter[:, :1, None, None]) * jitter[:, 1:, None, None]
    np.testing.assert_allclose(rest(pipeline.jitter_colors(normalize(images), jitter)),
                               rest(jittered), rtol=1e-5, atol=1e-5)


def test_a_model_without_a_normalize_layer_cannot_take_jitter():
    from distributed_mpt.core import models

    images = keras.Input((32, 32, 3), dtype="uint8")
    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))
    model = keras.Model(images, keras.layers.Dense(10)(x))
    with pytest.raises(models.ModelError, match="--model=mine.py:net: color jitter") as error:
        models.split_at_normalization(model, "mine.py:net")
    assert "\n" not in str(error.value)


def _evaluator(views, fraction, batch=16):
    """The Evaluator of a tiny airbench whose weights are spread (a random
    network on random images is too unsure of everything)."""
    from distributed_mpt.core.eval_views import EvalViews, Evaluator

    model = _tiny_airbench()
    for variable in model.trainable_variables:
        variable.assign(variable * 3.0)
    return Evaluator(model, tf.distribute.get_strategy(), batch, EvalViews(views, fraction))


def _test_split(count=100):
    from distributed_mpt.core.data import ImageSplit

    rng = np.random.default_rng(1)
    return ImageSplit(rng.integers(0, 256, (count, 32, 32, 3)).astype(np.uint8),
                      rng.integers(0, 10, count).astype(np.int32))


def _scores(logits, labels):
    """Accuracy and mean cross-entropy of `logits`, in NumPy."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return (np.mean(logits.argmax(1) == labels),
            -log_probabilities[np.arange(len(labels)), labels].mean())


def test_selective_tta_augments_only_the_least_confident_images():
    from distributed_mpt.core import eval_views

    evaluator, split = _evaluator("flip_translate_mean", 0.25), _test_split()
    views = eval_views.views_of(tf.constant(split.images), "flip_translate_mean")
    logits = [evaluator.model(view, training=False).numpy().astype(np.float64) for _, view in views]
    plain = logits[0]
    confidence = tf.nn.softmax(plain).numpy().max(axis=1)
    chosen = np.argsort(confidence, kind="stable")[:25]
    final = plain.copy()
    final[chosen] = np.mean(logits, axis=0)[chosen]
    assert (final.argmax(1) != plain.argmax(1)).any(), "TTA changes some answers"
    result = evaluator.evaluate(split)
    accuracy, loss = _scores(final, split.labels)
    assert result["eval_examples"] == 100
    assert result["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert result["eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert result["eval_accuracy_without_tta"] == pytest.approx(_scores(plain, split.labels)[0])
    # Not the most confident quarter, nor any other: the least.
    final[chosen] = plain[chosen]
    confident = np.argsort(confidence, kind="stable")[-25:]
    final[confident] = np.mean(logits, axis=0)[confident]
    assert _scores(final, split.labels)[1] != pytest.approx(result["eval_loss"], rel=1e-4)


def test_selective_tta_of_every_image_is_full_tta_and_of_none_the_plain_view():
    split = _test_split()
    full = _evaluator("flip_translate_mean", 1.0).evaluate(split)
    every = _evaluator("flip_translate_mean", 1.0)._evaluate_selectively(split, 1.0)
    assert every.keys() == full.keys()
    for key in full:
        assert every[key] == pytest.approx(full[key], rel=1e-5), key
    plain = _evaluator("none", 1.0).evaluate(split)
    none = _evaluator("flip_translate_mean", 0.001).evaluate(split)  # int(100 x 0.001) = 0
    assert none["eval_accuracy"] == none["eval_accuracy_without_tta"] == plain["eval_accuracy"]
    assert none["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert full["eval_accuracy"] != plain["eval_accuracy"] or \
        full["eval_loss"] != pytest.approx(plain["eval_loss"], rel=1e-3), "TTA does something"


@pytest.mark.slow
def test_two_replicas_match_one_with_every_option_of_the_record(tmp_path):
    # The second run keeps the split on its devices: the jitter travels
    # with the indices there.
    common = [*RECORD, "--train_steps=4", "--eval_tta=flip_translate_mean",
              "--eval_tta_fraction=0.25"]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path,
                                                      two_only=["--data_on_device"])
    # Muon lifts float32 round-off (see test_airbench94.py's bound).
    assert_same_weights(mirrored, single, rtol=1e-4, atol=2e-4)
    a, b = read_summary(tmp_path / "one"), read_summary(tmp_path / "two")
    assert a["eval_examples"] == b["eval_examples"]
    for key in ("eval_accuracy", "eval_accuracy_without_tta"):
        assert abs(a[key] - b[key]) <= 1 / a["eval_examples"] + 1e-9, key


@pytest.mark.slow
def test_a_resumed_run_with_every_option_of_the_record_ends_as_an_uninterrupted_one(tmp_path):
    # The renormalization table, the jitter and the frozen bias all hang on
    # the step, which the checkpoint holds.
    common = [*RECORD, "--train_steps=40", "--noevaluate", "--steps_per_loop=4"]
    expected, resumed = weights_of_whole_and_resumed(common, tmp_path, steps=40)
    assert_same_weights(resumed, expected, rtol=1e-5, atol=1e-5)


def test_jitter_with_a_users_model_without_normalize_is_one_error_line(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text("import keras\n\n\ndef net(info):\n"
                      "    images = keras.Input(info.image_shape, dtype='uint8')\n"
                      "    x = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(images))\n"
                      "    return keras.Model(images, keras.layers.Dense(info.num_classes)(x))\n")
    result = train(["--dataset=synthetic", "--synthetic_examples=256", "--precision=float32",
                    f"--model={source}:net", "--brightness_jitter=0.1", "--train_steps=2",
                    f"--model_dir={tmp_path / 'run'}"])
    assert_one_error_line(result, "color jitter (--brightness_jitter, --contrast_jitter) needs")


@pytest.mark.parametrize("views, fraction", [("flip_translate_mean", 0.25), ("flip", 1.0)])
def test_a_model_that_gives_probabilities_is_scored_as_training_scores_it(views, fraction):
    """An export gives probabilities, not logits: eval_views.class_probabilities
    (what distributed-mpt-predict --tta runs) must give training's own
    evaluation's answers, image by image, though its batches split the chosen
    images. (Its loss on a normal model: test_predict.py; this model's logits
    are spread so far that its probabilities underflow.)"""
    from distributed_mpt.core import eval_views

    evaluator, split = _evaluator(views, fraction), _test_split()
    probabilities = lambda x: tf.nn.softmax(  # noqa: E731
        tf.cast(evaluator.model(x, training=False), tf.float32)).numpy()
    p = eval_views.class_probabilities(probabilities, split.images, views, fraction, batch_size=7)
    plain = eval_views.class_probabilities(probabilities, split.images, batch_size=7)
    # What training's evaluation computes, image by image: the views' logits averaged.
    pairs = eval_views.views_of(tf.constant(split.images), views)
    logits = sum(w * evaluator.model(view, training=False).numpy().astype(np.float64)
                 for w, view in pairs)
    chosen = np.argsort(plain.max(axis=1), kind="stable")[:int(len(plain) * fraction)]
    want = plain.argmax(1)
    want[chosen] = logits.argmax(1)[chosen]
    np.testing.assert_array_equal(p.argmax(1), want)
    assert (p.argmax(1) != plain.argmax(1)).any(), "the views change some answers"
    result = evaluator.evaluate(split)
    assert np.mean(p.argmax(1) == split.labels) == pytest.approx(result["eval_accuracy"], abs=1e-9)
    assert np.mean(plain.argmax(1) == split.labels) == pytest.approx(
        result["eval_accuracy_without_tta"], abs=1e-9)


def test_evaluation_batches_are_bounded_whatever_the_training_batch(monkeypatch):
    # Evaluation keeps no activations for a backward pass: a training batch
    # of thousands would only make its maps larger (120 MB more at 1536 in
    # bfloat16). The results are the same at any batch.
    from distributed_mpt.core import eval_views

    monkeypatch.setattr(eval_views, "EVAL_BATCH_PER_REPLICA", 32)
    split, results, seen = _test_split(), [], []
    for batch in (16, 96):
        evaluator = _evaluator("flip_translate_mean", 0.25, batch=batch)
        call = evaluator.model.call
        evaluator.model.call = lambda x, *a, **k: (seen.append(x.shape[0]), call(x, *a, **k))[1]
        results.append(evaluator.evaluate(split))
    assert max(seen) == 32 and 16 in seen, seen
    for name in ("eval_accuracy", "eval_accuracy_without_tta", "eval_examples"):
        assert results[0][name] == results[1][name]
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-5)
