"""Every model takes uint8 images and gives float32 probabilities under every policy."""

import keras
import numpy as np
import pytest

from distributed_mpt.training.checkpointing import model_identity
from distributed_mpt.training import datasets, models
from distributed_mpt.training.models import build_model


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", ["mlp", "resnet9", "airbench"])
def test_model_outputs_float32_probabilities(name, policy):
    keras.mixed_precision.set_global_policy(policy)
    model = build_model(name, width=8, weight_decay=5e-4)
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    probabilities = model(images, training=False)
    assert probabilities.dtype == "float32" and tuple(probabilities.shape) == (3, 10)
    np.testing.assert_allclose(np.sum(probabilities, axis=-1), 1.0, rtol=1e-3)
    assert model.losses, "weight decay adds L2 losses"
    if policy != "float32":
        hidden = [l for l in model.layers if isinstance(l, keras.layers.Dense)][0]
        assert hidden.compute_dtype != "float32" and hidden.kernel.dtype == "float32"


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


def test_airbench_whitening_layer_whitens_image_patches():
    train, _ = datasets.make_synthetic(num_train=600, num_test=1, seed=0)
    model = build_model("airbench", width=8)
    models.initialize_from_data(model, train.images)
    whiten = model.get_layer("whiten")
    assert [v.name for v in whiten.trainable_variables] == ["bias"], \
        "the filters are computed from the data, not learned; the bias trains (airbench94)"
    np.testing.assert_array_equal(whiten.get_weights()[0], models.whitening_filters(train.images))
    # The first half of the filters maps 2x2 patches of normalized images to
    # uncorrelated unit-variance outputs; the second half is its negative.
    normalized = (train.images - np.float32(datasets.CIFAR10_MEAN)) / np.float32(datasets.CIFAR10_STD)
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
