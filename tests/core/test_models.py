"""Every model takes uint8 images and gives logits under every policy, which
its export turns into float32 probabilities; weight decay is the
optimizer's, not the model's."""

import keras
import numpy as np
import pytest
from conftest import group_settings

from distributed_mpt.core import models
from distributed_mpt.core.data import cifar10, synthetic
from distributed_mpt.core.models.layers import WhiteningConv2D
from distributed_mpt.core.optim import groups
from distributed_mpt.training import outputs
from distributed_mpt.training.checkpoints import model_identity


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def build_model(name, width=64, **options):
    return models.build_model(models.model_spec(name), cifar10.INFO, width, **options)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", list(models.MODELS))  # a new model is tested too
def test_model_outputs_logits_and_its_export_float32_probabilities(name, policy):
    keras.mixed_precision.set_global_policy(policy)
    model = build_model(name, width=8)
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    logits = np.asarray(model(images, training=False), np.float32)
    assert logits.shape == (3, 10) and np.all(np.isfinite(logits))
    assert not np.allclose(logits.sum(axis=-1), 1.0, atol=1e-3), "logits, not probabilities"
    # What a user's Keras loads: the same network, ending in a float32 softmax.
    probabilities = outputs._keras_model_with_probabilities(model, (32, 32, 3))(images, training=False)
    assert probabilities.dtype == "float32" and tuple(probabilities.shape) == (3, 10)
    np.testing.assert_allclose(np.sum(probabilities, axis=-1), 1.0, rtol=1e-3)
    np.testing.assert_allclose(probabilities, keras.ops.softmax(logits), rtol=1e-2, atol=1e-3)
    assert not model.losses, "no regularizers in the model: the optimizer decays"
    if policy != "float32":
        hidden = [l for l in model.layers if isinstance(l, keras.layers.Dense)][0]
        assert hidden.compute_dtype != "float32" and hidden.kernel.dtype == "float32"


@pytest.mark.parametrize("name", list(models.MODELS))
def test_weight_decay_is_a_parameter_group_of_every_kernel(name):
    """What the models' L2 regularizers did, by groups: kernels decay by c,
    batch-norm shifts by c / the shift multiplier, biases and scales not."""
    model = build_model(name, width=8)
    made = groups.parameter_groups(model, group_settings(
        0.1, weight_decay=5e-4, momentum=0.9, shift_lr_multiplier=4.0))
    by_variable = {id(v): group for group in made for v in group.variables}
    assert len(by_variable) == sum(len(g.variables) for g in made), "no variable in two groups"
    assert set(by_variable) == {id(v) for v in model.trainable_variables}, "every one in one"
    shifts = {id(layer.beta) for layer in model.layers
              if isinstance(layer, keras.layers.BatchNormalization)}
    for variable in model.trainable_variables:
        decay = by_variable[id(variable)].weight_decay
        if id(variable) in shifts:
            assert decay == pytest.approx(5e-4 / 4.0), variable.path
        elif len(variable.shape) >= 2 or "whiten" in variable.path:
            assert decay == 5e-4, variable.path  # as the kernel and whitening-bias L2 was
        else:
            assert decay == 0.0, variable.path
    assert any(len(v.shape) >= 2 for v in model.trainable_variables)


def test_mlp_is_the_notebooks_network():
    model = build_model("mlp")
    dense = [l.units for l in model.layers if isinstance(l, keras.layers.Dense)]
    assert dense == [3000, 1000, 10]
    assert model.count_params() == (3072 * 3000 + 3000) + (3000 * 1000 + 1000) + (1000 * 10 + 10)


def test_identity_tells_models_and_precisions_apart():
    def identity(name, width=8, policy="float32"):
        return model_identity(build_model(name, width=width), policy)

    assert identity("mlp") != identity("resnet9")
    assert identity("resnet9", width=8) != identity("resnet9", width=16)
    assert identity("resnet9") != identity("resnet9", policy="mixed_float16")
    assert identity("resnet9") == identity("resnet9")


def test_each_model_is_declared_once_with_its_defaults():
    assert {"mlp", "resnet9", "airbench"} <= set(models.MODELS), "a new one adds to them"
    assert models.MODELS["airbench"].defaults.values() == dict(
        learning_rate=0.1875, max_learning_rate=0.0, warmup_epochs=1.5, momentum=0.85,
        weight_decay=6.65e-4, label_smoothing=0.2)
    assert {name: models.has_batch_norm(build_model(name, width=4))
            for name in ("mlp", "resnet9", "airbench")} == \
        {"mlp": False, "resnet9": True, "airbench": True}, \
        "whether replicas synchronize inside the forward pass"
    with pytest.raises(models.ModelError, match="not one of mlp, resnet9, airbench"):
        models.model_spec("vgg16")


def test_airbench_whitening_layer_whitens_image_patches():
    train, _ = synthetic.make_synthetic(num_train=600, num_test=1, seed=0)
    model = build_model("airbench", width=8)
    models.initialize_from_data(model, train.images)
    whiten = model.get_layer("whiten")
    assert isinstance(whiten, WhiteningConv2D)
    assert [v.name for v in whiten.trainable_variables] == ["bias"], \
        "the filters are computed from the data, not learned; the bias trains (airbench94)"
    np.testing.assert_array_equal(whiten.get_weights()[0], whiten.whitening_filters(train.images))
    # The first half of the filters maps 2x2 patches of normalized images to
    # uncorrelated unit-variance outputs; the second half is its negative.
    normalized = (train.images - np.float32(cifar10.INFO.mean)) / np.float32(cifar10.INFO.std)
    outputs = np.asarray(keras.ops.conv(normalized, whiten.get_weights()[0][..., :12]))
    outputs = outputs.reshape(-1, 12).astype(np.float64)
    np.testing.assert_allclose(outputs.T @ outputs / len(outputs), np.eye(12), atol=0.02)


def test_airbench_convolutions_start_as_the_identity_unless_told_otherwise():
    def kernels(**kwargs):
        keras.utils.set_random_seed(0)
        model = build_model("airbench", width=8, **kwargs)
        return [keras.ops.convert_to_numpy(layer.kernel) for layer in model.layers
                if isinstance(layer, keras.layers.Conv2D) and layer.name != "whiten"]

    for kernel in kernels():
        _, _, channels_in, channels_out = kernel.shape
        first = min(channels_in, channels_out)
        # Filter j of the first c_in passes input channel j through, unchanged.
        dirac = np.zeros((3, 3, channels_in, first), np.float32)
        dirac[1, 1, np.arange(first), np.arange(first)] = 1
        np.testing.assert_array_equal(kernel[..., :first], dirac)
        assert np.all(kernel[..., first:] != 0), "the other filters stay random"
    for kernel, identity in zip(kernels(identity_init=False), kernels()):
        first = min(kernel.shape[2:])
        assert np.all(kernel[..., :first] != 0), "--noidentity_init: every filter random"
        np.testing.assert_array_equal(kernel[..., first:], identity[..., first:])


def test_airbench_options_reach_its_layers():
    train, _ = synthetic.make_synthetic(num_train=600, num_test=1, seed=0)
    model = build_model("airbench", width=8, activation="silu", bn_momentum=0.5,
                        whiten_images=100)
    models.initialize_from_data(model, train.images)
    activations = [layer.get_config()["activation"] for layer in model.layers
                   if isinstance(layer, keras.layers.Activation)]
    assert activations == ["gelu"] + ["silu"] * 6, "the whitening layer's stays GELU"
    assert {layer.momentum for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)} == {0.5}
    whiten = model.get_layer("whiten")
    np.testing.assert_array_equal(whiten.get_weights()[0], whiten.whitening_filters(train.images[:100]))
    assert not np.array_equal(whiten.get_weights()[0], whiten.whitening_filters(train.images))
    with pytest.raises(models.ModelError, match="tanh"):
        build_model("airbench", width=8, activation="tanh")
