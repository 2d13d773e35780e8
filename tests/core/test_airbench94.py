"""The parts of the airbench94 recipe, each an option of the package: they do
what airbench does, touch only what they should, and keep the loop's
promises (N replicas = 1 replica, a resume that is step-exact)."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (assert_ok, assert_same_weights, checkpoint_weights, group_settings, train,
                      weights_of_one_and_two_replicas, weights_of_whole_and_resumed)
from distributed_mpt.core import data, eval_views, models, pipeline
from distributed_mpt.core.augmentation import Augmentation
from distributed_mpt.core.data import ImageSplit, cifar10
from distributed_mpt.core.optim import groups, schedules
from distributed_mpt.core.optim.lookahead import Lookahead
from distributed_mpt.core.optim.optimizer import GroupedOptimizer
from distributed_mpt.core.optim.rules import Muon, NesterovSGD, orthogonalize
from distributed_mpt.core.steps import StepRules, Trainer

# A tiny airbench with every part of the recipe on, on synthetic data.
AIRBENCH94 = ["--dataset=synthetic", "--synthetic_examples=256", "--model=airbench",
              "--model_width=8", "--per_replica_batch_size=32", "--lr_schedule=piecewise_linear",
              "--warmup_epochs=0.5", "--shift_lr_multiplier=64", "--whiten_bias_epochs=1",
              "--lookahead", "--crop_padding=2", "--flip=alternating", "--precision=float32",
              "--noexport"]


def _images(count=4, size=6):
    return tf.constant(np.random.default_rng(0).integers(0, 256, (count, size, size, 3)),
                       tf.uint8)


def test_test_time_views_are_the_ones_named():
    images = _images()
    mirror = images[:, :, ::-1]
    assert [w for w, _ in eval_views.views_of(images, "none")] == [1.0]
    flip = eval_views.views_of(images, "flip")
    assert [w for w, _ in flip] == [0.5, 0.5]
    np.testing.assert_array_equal(flip[0][1], images)
    np.testing.assert_array_equal(flip[1][1], mirror)

    six = eval_views.views_of(images, "flip_translate")
    assert [w for w, _ in six] == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    padded = np.pad(images.numpy(), [(0, 0), (1, 1), (1, 1), (0, 0)], mode="reflect")
    down_right, up_left = padded[:, :-2, :-2], padded[:, 2:, 2:]
    expected = [images, mirror, down_right, down_right[:, :, ::-1], up_left, up_left[:, :, ::-1]]
    for (_, view), want in zip(six, expected):
        np.testing.assert_array_equal(view, want)
    # One pixel each way along the diagonal: the centre of the view moved.
    np.testing.assert_array_equal(down_right[:, 1:, 1:], images[:, :-1, :-1])


def test_alternating_flips_show_each_image_both_ways_in_two_epochs():
    # Each image is its own label, and asymmetric: column 0 holds 1, the
    # rest 0, so a flipped copy has its 1 in the last column.
    count = 64
    images = np.zeros((count, 32, 32, 3), np.uint8)
    images[:, :, 0] = 1
    split = ImageSplit(images, np.arange(count, dtype=np.int32))
    dataset_fn = pipeline.train_input_fn(split, global_batch_size=16, seed=5, start_step=0,
                                         num_steps=3 * count // 16,
                                         augmentation=Augmentation(0, "alternating"))
    context = tf.distribute.InputContext()
    flipped = [{}, {}, {}]  # per epoch: image -> flipped?
    for step, (batch, labels) in enumerate(dataset_fn(context)):
        for image, label in zip(batch.numpy(), labels.numpy()):
            flipped[step // (count // 16)][label] = bool(image[0, -1, 0])
    first = np.array([flipped[0][i] for i in range(count)])
    assert 0.2 < first.mean() < 0.8, "each image flipped at random once"
    np.testing.assert_array_equal([flipped[1][i] for i in range(count)], ~first)
    np.testing.assert_array_equal([flipped[2][i] for i in range(count)], first)


def test_piecewise_linear_schedule_is_airbench94s():
    schedule = schedules.learning_rate_schedule(2.0, total_steps=100, warmup_steps=23,
                                                kind="piecewise_linear")
    rates = [float(schedule(step)) for step in (0, 23, 100)]
    np.testing.assert_allclose(rates, [0.4, 2.0, 0.14], rtol=1e-6)
    np.testing.assert_allclose(float(schedule(61.5)), (2.0 + 0.14) / 2, rtol=1e-6)


def test_linear_schedule_warms_up_then_falls_to_zero():
    schedule = schedules.learning_rate_schedule(2.0, total_steps=100, warmup_steps=20,
                                                kind="linear")
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 10, 20, 60, 100)],
                               [0.0, 1.0, 2.0, 1.0, 0.0], atol=1e-6)
    # Without warmup, as Muon's whitening bias falls over its epochs.
    bias_rate = schedules.learning_rate_schedule(2.0, total_steps=10, warmup_steps=0,
                                                 kind="linear")
    np.testing.assert_allclose([float(bias_rate(s)) for s in (0, 5, 10)], [2.0, 1.0, 0.0],
                               atol=1e-6)


def test_lookahead_pulls_every_fifth_step_and_ends_on_the_average():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    kernel = model.weights[0]
    # A fixed start far from zero: a random one near zero made a float32
    # rounding error look like a 1e-6 relative miss.
    start = np.array([[0.5], [-1.5]], np.float32)
    kernel.assign(start)
    lookahead = Lookahead(model, total_steps=12)
    average = lookahead.state.averages[0]

    kernel.assign(start + 1.0)
    lookahead.after_step(tf.constant(4, tf.int64))  # not a fifth step: nothing moves
    np.testing.assert_array_equal(average.numpy(), start)
    np.testing.assert_array_equal(kernel.numpy(), start + 1.0)

    lookahead.after_step(tf.constant(5, tf.int64))
    keep = 0.95 ** 5 * (5 / 12) ** 3
    np.testing.assert_allclose(average.numpy(), keep * start + (1 - keep) * (start + 1), rtol=1e-6)
    np.testing.assert_array_equal(kernel.numpy(), average.numpy())

    kernel.assign(start + 5.0)
    lookahead.after_step(tf.constant(12, tf.int64))  # the last step: the average, unmoved
    np.testing.assert_array_equal(kernel.numpy(), average.numpy())


def _trained_variables(model_dir) -> list:
    """The trained variables of the tiny airbench's checkpoint, in the
    order of `model.trainable_variables` (the checkpoint keeps each under
    the optimizer, which tracks them in that order)."""
    saved = checkpoint_weights(model_dir)
    return [saved[f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"]
            for i in range(len(_TINY.trainable_variables))]


def _build(width=8, **options):
    return models.build_model(models.model_spec("airbench"), cifar10.INFO, width, **options)


_TINY = _build()


def _indices(variables) -> list:
    return [i for i, v in enumerate(_TINY.trainable_variables) if any(v is w for w in variables)]


def _batch_norm_shifts(model) -> list:
    """The batch-norm shifts (beta), found from the layers, not from the
    parameter groups that are checked against them."""
    return [layer.beta for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)]


def _filters(model) -> list:
    """The trained 3x3 convolution kernels (not the whitening filters)."""
    return [layer.kernel for layer in model.layers
            if isinstance(layer, keras.layers.Conv2D) and layer.name != "whiten"]


def _settings(**overrides) -> groups.Settings:
    return group_settings(0.5, **{**dict(weight_decay=0.1, momentum=0.9,
                                         shift_lr_multiplier=64.0, whiten_bias_epochs=10),
                                  **overrides})


def _same(variables, expected) -> bool:
    return len(variables) == len(expected) and all(v is w for v, w in zip(variables, expected))


def test_the_shift_multiplier_is_the_rate_of_the_batch_norm_shifts_alone():
    # The groups, then one step's arithmetic from random weights and a
    # gradient of ones: each variable moves by (1 + momentum) x the run's
    # rate x its group's rate x (1 + 2 x its decay x w) (Nesterov's first
    # step), so shifts move 64 times as far, with the kernels' decay per step.
    model = _build()
    made = {group.name: group for group in groups.parameter_groups(model, _settings())}
    assert list(made) == ["whitening bias", "filters", "shifts", "kernels"]
    assert _same(made["shifts"].variables, _batch_norm_shifts(model))
    assert len(made["shifts"].variables) == 6, "two batch norms in each of three stages"
    assert made["shifts"].rate == 64 and made["shifts"].weight_decay == pytest.approx(0.1 / 64)
    assert all(group.rate == 1 and group.schedule is None
               for name, group in made.items() if name != "shifts")
    rng = np.random.default_rng(3)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(size=variable.shape).astype(np.float32))
    start = [v.numpy() for v in model.trainable_variables]
    optimizer = GroupedOptimizer(list(made.values()), lambda step: 0.5,
                                 tf.Variable(0, dtype=tf.int64))
    optimizer.apply_gradients([(tf.ones_like(v), v) for v in model.trainable_variables])
    group_of = {id(v): group for group in made.values() for v in group.variables}
    for variable, w in zip(model.trainable_variables, start):
        group = group_of[id(variable)]
        expected = w - 1.9 * 0.5 * group.rate * (1 + 2 * group.weight_decay * w)
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6,
                                   err_msg=variable.path)


def test_the_shift_multiplier_speeds_up_only_batch_norm_shifts(tmp_path):
    # One step from the same start: the update of each variable is its
    # first gradient times the learning rate, so every kernel moves alike
    # and every shift (zero at the start) moves 64 times as far.
    runs = {}
    for multiplier in (1, 64):
        model_dir = tmp_path / str(multiplier)
        assert_ok(train([*AIRBENCH94, "--train_steps=1", "--nolookahead", "--noevaluate",
                         f"--shift_lr_multiplier={multiplier}", f"--model_dir={model_dir}"]))
        runs[multiplier] = _trained_variables(model_dir)
    shifts = _indices(_batch_norm_shifts(_TINY))
    assert len(shifts) == 6, "two batch norms in each of three stages"
    for i, (plain, fast) in enumerate(zip(runs[1], runs[64])):
        if i in shifts:
            assert np.abs(plain).max() > 0
            np.testing.assert_allclose(fast, 64 * plain, rtol=1e-4, err_msg=str(i))
        else:
            np.testing.assert_array_equal(fast, plain, err_msg=str(i))


def test_the_whitening_bias_trains_only_when_asked(tmp_path):
    [bias] = _indices([_TINY.get_layer("whiten").bias])
    biases = {}
    for epochs in (0, 1):
        model_dir = tmp_path / str(epochs)
        assert_ok(train([*AIRBENCH94, "--train_steps=4", "--noevaluate", "--nolookahead",
                         f"--whiten_bias_epochs={epochs}", f"--model_dir={model_dir}"]))
        biases[epochs] = _trained_variables(model_dir)[bias]
    assert not biases[0].any()
    assert biases[1].any()


def _ops_of(concrete_function) -> list:
    """The op types of a traced function, its nested functions' included."""
    graph = concrete_function.graph.as_graph_def()
    return ([node.op for node in graph.node]
            + [node.op for function in graph.library.function for node in function.node_def])


@pytest.mark.parametrize("freeze", groups.FREEZES)
def test_once_the_whitening_bias_freezes_its_backward_pass_is_skipped_and_nothing_changes(freeze):
    # Two trainers from the same weights on the same batches, one told that
    # the bias freezes after 3 steps: 7 steps in calls of 2 and 5 (the second
    # call crosses the freeze and is split), then the same weights, and
    # optimizer slots, to float32 round-off.
    dataset = data.DataOptions("synthetic", synthetic_examples=256).load(seed=0)
    strategy = tf.distribute.get_strategy()
    results, trainers = {}, {}
    for pruned in (False, True):
        keras.utils.set_random_seed(0)
        model = _build(width=4)
        step = tf.Variable(0, dtype=tf.int64)
        made = groups.parameter_groups(model, _settings(whiten_bias_epochs=3,
                                                        whiten_bias_freeze=freeze))
        optimizer = GroupedOptimizer(made, schedules.learning_rate_schedule(0.05, 7, 0, "linear"),
                                     step)
        optimizer.build(model.trainable_variables)
        frozen = groups.freezes(made)
        assert [(steps, _same(variables, [model.get_layer("whiten").bias]))
                for steps, variables in frozen] == [(3, True)]
        trainer = Trainer(model, optimizer, strategy, step,
                          StepRules(global_batch_size=32, frozen=frozen if pruned else ()))
        iterator = iter(strategy.distribute_datasets_from_function(
            pipeline.train_input_fn(dataset.train, 32, seed=0, start_step=0, num_steps=7)))
        for steps in (2, 5):
            trainer.train(iterator, steps)
        assert int(step.numpy()) == 7
        results[pruned] = [v.numpy() for v in (*model.weights, *optimizer.variables)]
        trainers[pruned] = trainer
    for name, (whole, pruned) in enumerate(zip(results[False], results[True])):
        np.testing.assert_allclose(pruned, whole, rtol=1e-5, atol=1e-7, err_msg=str(name))

    # The skipped part: the first convolution's input gradient, which only
    # the bias needs (the other convolutions' are still computed).
    images, labels = next(iter(pipeline.train_input_fn(
        dataset.train, 32, seed=0, start_step=0, num_steps=1)(tf.distribute.InputContext())))
    compute = tf.function(trainers[True]._compute_gradients)
    [bias] = [i for i, v in enumerate(trainers[True].model.trainable_variables)
              if v.path.startswith("whiten/")]
    counts = [_ops_of(compute.get_concrete_function(images, labels, frozen=frozen))
              .count("Conv2DBackpropInput") for frozen in ((), (bias,))]
    assert counts[1] == counts[0] - 1 >= 5, counts


def test_muon_orthogonalizes_keeping_the_singular_vectors():
    rng = np.random.default_rng(0)
    left, _ = np.linalg.qr(rng.normal(size=(576, 64)))
    right, _ = np.linalg.qr(rng.normal(size=(64, 64)))
    spread = np.geomspace(1, 10, 64)  # singular values over a decade
    gradient = (left * spread) @ right.T
    update = orthogonalize(tf.constant(gradient, tf.float32)).numpy()
    in_its_basis = left.T @ update @ right  # diagonal if the singular vectors are kept
    singular = np.diag(in_its_basis)
    assert 0.5 < singular.min() and singular.max() < 1.5, "near 1, not spread over a decade"
    off_diagonal = in_its_basis - np.diag(singular)
    assert np.abs(off_diagonal).max() < 0.05 * singular.max()


def test_a_muon_step_renormalizes_the_filter_and_steps_along_the_orthogonalized_momentum():
    kernel = keras.Variable(np.random.default_rng(1).normal(size=(3, 3, 4, 8)), dtype="float32")
    bias = keras.Variable(np.zeros(8), dtype="float32")
    optimizer = GroupedOptimizer([groups.ParameterGroup("filters", (kernel,), Muon(0.6), rate=0.2),
                                  groups.ParameterGroup("others", (bias,), NesterovSGD(0.9))],
                                 lambda step: 0.5, tf.Variable(0, dtype=tf.int64))
    gradient = tf.constant(np.random.default_rng(2).normal(size=(3, 3, 4, 8)), tf.float32)
    start = kernel.numpy()
    optimizer.apply_gradients([(gradient, kernel), (tf.ones(8), bias)])
    # First step: momentum = gradient, Nesterov direction = 1.6 x gradient,
    # whose orthogonalization is that of the gradient.
    renormalized = start * np.sqrt(8) / np.linalg.norm(start)
    step = orthogonalize(tf.reshape(1.6 * gradient, [-1, 8])).numpy().reshape(start.shape)
    np.testing.assert_allclose(kernel.numpy(), renormalized - 0.2 * 0.5 * step, rtol=1e-4, atol=1e-5)
    # The other variables take SGD's step: 0.5 x (1 + 0.9) Nesterov.
    np.testing.assert_allclose(bias.numpy(), -0.95 * np.ones(8), rtol=1e-6)


@pytest.mark.parametrize("rule", ["sgd", "muon"])
def test_under_muon_the_filters_carry_no_weight_decay_and_the_whitening_bias_decays_as_a_shift(
        rule):
    # The groups' decay, and the update it causes: one step of zero
    # gradients, so that the decay is all that moves a variable.
    muon = rule == "muon"
    model = _build()
    made = {group.name: group for group in groups.parameter_groups(
        model, _settings(optimizer=rule, muon_learning_rate=0.2,  # 0.4 x the peak
                         muon_momentum=0.6))}
    filters, bias = made["filters"], made["whitening bias"]
    assert _same(filters.variables, _filters(model)) and len(filters.variables) == 6
    assert isinstance(filters.rule, Muon if muon else NesterovSGD)
    assert filters.weight_decay == (0.0 if muon else 0.1)
    assert _same(bias.variables, [model.get_layer("whiten").bias])
    assert bias.weight_decay == pytest.approx(0.1 / 64 if muon else 0.1)

    bias.variables[0].assign(tf.ones_like(bias.variables[0]))
    start = {id(v): v.numpy() for v in model.trainable_variables}
    optimizer = GroupedOptimizer(list(made.values()), lambda step: 0.5,
                                 tf.Variable(0, dtype=tf.int64))
    optimizer.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])
    for kernel in filters.variables:
        w = start[id(kernel)]
        # Muon only renormalizes (its step along a zero momentum is zero);
        # SGD's decay pulls every filter toward zero: 1.9 x 0.5 x 2 x 0.1 w.
        expected = w * np.sqrt(w.shape[-1]) / np.linalg.norm(w) if muon else w * (1 - 0.19)
        np.testing.assert_allclose(kernel.numpy(), expected, rtol=1e-5, atol=1e-7,
                                   err_msg=kernel.path)
    # SGD: decay 0.1 at the run's rate 0.5. Muon: decay 0.1 / 64 at its own
    # rate, 64 x the peak 0.5 at the first step: the same pull per step.
    np.testing.assert_allclose(bias.variables[0].numpy(), 1 - 1.9 * 0.5 * 2 * 0.1, rtol=1e-5)


def test_under_muon_the_whitening_bias_trains_at_the_shifts_rate(tmp_path):
    # One step from the same start (the bias is zero, so no decay term), at
    # the peak rate (a 1-step run has no warmup): the bias moves 64 times as
    # far as SGD moves it. Its rate's fall over its epochs is the linear
    # schedule's, checked with the schedules.
    [bias] = _indices([_TINY.get_layer("whiten").bias])
    moved = {}
    for optimizer in ("sgd", "muon"):
        model_dir = tmp_path / optimizer
        assert_ok(train([*AIRBENCH94, "--train_steps=1", "--nolookahead", "--noevaluate",
                         f"--optimizer={optimizer}", f"--model_dir={model_dir}"]))
        moved[optimizer] = _trained_variables(model_dir)[bias]
    assert np.abs(moved["sgd"]).max() > 0
    np.testing.assert_allclose(moved["muon"], 64 * moved["sgd"], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, steps, atol", [
    ("sgd", 10, 2e-5),
    # Muon's orthogonalization lifts the gradient's smallest singular
    # directions, float32 round-off among them, to the size of its step,
    # and each step feeds the next: fewer steps (too few for lookahead's
    # first pull, which the SGD case checks, so without it), a looser bound.
    ("muon", 3, 2e-4),
])
def test_two_replicas_match_one_with_every_part_of_the_recipe(tmp_path, optimizer, steps, atol):
    common = [*AIRBENCH94, f"--train_steps={steps}", "--noevaluate", f"--optimizer={optimizer}",
              *(["--nolookahead"] if optimizer == "muon" else [])]
    single, mirrored = weights_of_one_and_two_replicas(common, tmp_path)
    if optimizer == "sgd":
        assert any(name.startswith("lookahead/") for name in single), "the averages are saved"
    assert_same_weights(mirrored, single, rtol=1e-4, atol=atol)


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    # Lookahead's averages and the alternating flips live across the stop.
    common = [*AIRBENCH94, "--train_steps=120", "--noevaluate", "--steps_per_loop=5"]
    expected, resumed = weights_of_whole_and_resumed(common, tmp_path, steps=120)
    assert_same_weights(resumed, expected, rtol=1e-5, atol=1e-6)
