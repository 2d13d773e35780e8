"""The networks the package trains, declared once each in `MODELS`, and the
user's own: `--model=path/to/file.py:function` or `package.module:function`.

A model is a function `(info, width) -> keras.Model` (a user's: `(info)`),
where `info` is the dataset's `DatasetInfo`. Its contract, checked before
any training (contract.py says it whole):
- it takes uint8 images [batch, *info.image_shape] (0-255; normalizing them
  is its job: `layers.normalized_input` does it with `info.mean`, `info.std`),
- it returns logits [batch, info.num_classes] in any floating-point dtype
  (a final softmax is dropped: the loss and test-time augmentation take
  logits, and the export adds the softmax back),
- it may use any Keras layers. Every BatchNormalization is made to
  synchronize its statistics across replicas, so that N replicas train like
  one; a layer with an `initialize_from_data(train_images)` method gets the
  first training images before training (airbench's whitening does).

A user's file is imported with its folder on the import path (after the
installed packages), so that it may import its own modules beside it.

This module imports no TensorFlow at import time, so that flags are checked
at once; `build_model` imports the builders.
"""

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from typing import List, Optional, Tuple

from distributed_mpt.core.models import contract, softmax
from distributed_mpt.core.models.contract import ModelError, users_code
from distributed_mpt.errors import ConfigError, UserError, first_line, quoted
from distributed_mpt.options import (MAX_EXAMPLES, Options, option, require, require_at_most,
                                     require_positive)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The settings a network trains well with at any global batch, each
    overridden by its flag: the learning rate at the reference batch of 128
    (scaled with the global batch), its ceiling (0: none), the warmup, SGD's
    momentum, the L2 coefficient and the label smoothing; `why` says why."""

    learning_rate: float
    max_learning_rate: float
    warmup_epochs: float
    momentum: float
    weight_decay: float
    label_smoothing: float
    why: str

    def values(self) -> dict:
        """The defaults by flag name, without `why`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "why"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A network: its --model name, one line saying what it is, its builder
    ("module:function", imported only to build; a user's file path or
    module), its defaults, and the options its builder takes as keyword
    arguments besides (info, width): fields of AirbenchOptions, the one
    network with options of its own."""

    name: str
    summary: str
    builder: str
    defaults: Defaults
    options: Tuple[str, ...] = ()

    @property
    def is_users(self) -> bool:
        return self.name == self.builder

    @property
    def identity(self) -> str:
        """What a checkpoint records of the network: its name, or a user's
        function name (Keras names a user's model by the order it was made
        in: `functional_2`), so that a moved file still resumes."""
        return self.builder.rpartition(":")[2] if self.is_users else self.name


# airbench's stages' activation: airbench94's exact GELU, the 2025 record's
# SiLU (hiverge/cifar10-speedrun), or ReLU, which TensorFlow fuses into
# batch norm (--activation).
AIRBENCH_ACTIVATIONS = ("gelu", "silu", "relu")

MODELS = {spec.name: spec for spec in (
    ModelSpec("mlp", "the original notebook's network", "distributed_mpt.core.models.mlp:build",
              Defaults(0.05, 0.05, 1.0, 0.9, 0.0, 0.0, why=(
                  "No normalization layer: its first layer sees 3,072 strongly correlated "
                  "pixels, so a rate of 0.1 can diverge at any batch (measured on synthetic "
                  "data: at batch 256 after a 16-step warmup, and on 2 x 1024), while 0.05 held "
                  "in every case: linear scaling stops there."))),
    ModelSpec("resnet9", "the residual CNN of Page's DAWNBench entries (94% in 24 epochs on a "
              "V100, as published)", "distributed_mpt.core.models.resnet9:build",
              Defaults(0.1, 0.0, 5.0, 0.9, 5e-4, 0.2, why=(
                  "Page's ResNet-9 settings (warmup to epoch 5 of 24, label smoothing 0.2 as in "
                  "his final version); batch norm makes it scale-invariant: no ceiling."))),
    ModelSpec("airbench", "Keller Jordan's airbench94 network, the CPU's choice "
              "(--recipe=cpu_cnn94 or cpu_cnn)", "distributed_mpt.core.models.airbench:build",
              Defaults(0.1875, 0.0, 1.5, 0.85, 6.65e-4, 0.2, why=(
                  "airbench94's rate, momentum and weight decay, converted (docs/recipes.md): "
                  "0.1875 at batch 128 and an L2 coefficient of 6.65e-4; the warmup is for the "
                  "default cosine schedule (the recipes set airbench94's own).")),
              options=("identity_init", "activation", "bn_momentum", "whiten_images")),
)}

# A user's network: the classic CIFAR ResNet recipe (He et al. 2016, sec.
# 4.2), a starting point to tune with the flags.
USER_DEFAULTS = Defaults(0.1, 0.0, 1.0, 0.9, 5e-4, 0.0, why=(
    "the classic CIFAR ResNet recipe (He et al. 2016): 0.1 at batch 128, momentum 0.9, "
    "L2 5e-4, with a one-epoch warmup; a starting point for a network of your own"))

_MAX_WIDTH = 1024  # resnet9 at 1024 already has 1.7 billion weights


@dataclasses.dataclass(frozen=True)
class ModelOptions(Options):
    """Which network a run trains, and how wide."""

    model: str = option(
        "resnet9", " ".join(f"{spec.name}: {spec.summary}." for spec in MODELS.values())
        + " Or your own network: path/to/file.py:function or package.module:function, a "
        "function of the dataset's info returning a Keras model from uint8 images to logits "
        "(docs/extending.md).")
    model_width: int = option(64, "Channels of the first stage of resnet9 or airbench (64 in "
                              "both references).")

    def check(self) -> None:
        try:
            model_spec(self.model)
        except UserError as e:
            raise ConfigError(str(e)) from None
        require_positive(self, "model_width")
        require_at_most(self, _MAX_WIDTH, "model_width")

    @property
    def spec(self) -> ModelSpec:
        return model_spec(self.model)

    def build(self, info, own: "AirbenchOptions", notes: Optional[List[str]] = None,
              batch_size: int = 2):
        """This network for dataset `info` (build_model), with the options of
        its own that `own` holds (spec.options names them), checked at a
        replica's training batch of `batch_size`."""
        return build_model(self.spec, info, self.model_width, notes, batch_size,
                           **self._own(own))

    def parameter_count(self, info, own: "AirbenchOptions"):
        """How many weights this network has for `info` (parameter_count)."""
        return parameter_count(self.spec, info, self.model_width, **self._own(own))

    def _own(self, own) -> dict:
        return {name: getattr(own, name) for name in self.spec.options}

    def too_large(self) -> Tuple[str, str]:
        """(the flags that name this network, what makes it smaller), for a
        network too large for the memory."""
        if self.spec.is_users:
            return f"--model={quoted(self.model)}", "a smaller network"
        return f"--model={self.model} at --model_width={self.model_width}", "a lower --model_width"


@dataclasses.dataclass(frozen=True)
class AirbenchOptions(Options):
    """airbench's own options (its builder's keyword arguments)."""

    identity_init: bool = option(
        True, "airbench: start each 3x3 convolution as the identity on its first c_in filters "
        "(airbench94's dirac_ initialization), so that each block passes its input through at "
        "first; --noidentity_init: every filter random, as PyTorch initializes them.")
    activation: str = option(
        "gelu", "airbench: the activation of its convolution stages. gelu (airbench94's), silu "
        "(the 2025 record's), relu (which TensorFlow fuses into batch norm); GELU and SiLU are "
        "compiled into one pass each way on CPUs (core/models/faster_layers.py).",
        AIRBENCH_ACTIVATIONS)
    bn_momentum: float = option(
        0.6, "airbench: its batch norms' momentum in Keras' sense (the weight of the old moving "
        "statistics; airbench94: 0.6, the 2025 record: 0.5566).")
    whiten_images: int = option(
        5000, "airbench: how many of the first training images its whitening filters are "
        "computed from (airbench94: 5000, the 2025 record: 960).")

    def check(self) -> None:
        require(0 <= self.bn_momentum < 1, f"--bn_momentum={self.bn_momentum} must be in [0, 1)")
        require(2 <= self.whiten_images <= MAX_EXAMPLES,
                f"--whiten_images={self.whiten_images} must be in [2, {MAX_EXAMPLES:,}]")


_MODULE_SOURCE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_FILE_SOURCE = re.compile(r".+\.py:[A-Za-z_]\w*")


def model_spec(model: str) -> ModelSpec:
    """The spec of `model`: a MODELS name, or a user's `file.py:function` or
    `package.module:function` (not imported yet). Raises ModelError for
    anything else."""
    if model in MODELS:
        return MODELS[model]
    if _FILE_SOURCE.fullmatch(model) or _MODULE_SOURCE.fullmatch(model):
        return ModelSpec(model, "your own network", model, USER_DEFAULTS)
    raise ModelError(f"--model={quoted(model)} is not one of {', '.join(MODELS)}, nor a "
                     f"function of yours as path/to/file.py:function or package.module:function")


def build_model(spec: ModelSpec, info, width: int = 64, notes: Optional[List[str]] = None,
                batch_size: int = 2, **options):
    """Builds `spec`'s network for dataset `info` under the current dtype
    policy (`options`: the flags `spec.options` names), checks it against
    the contract (contract.py; a user's model traced into a training step
    at a replica's batch of `batch_size`) and returns it, computing logits;
    what a user must be told of it (a final softmax dropped) is appended to
    `notes`. A model that breaks the contract raises ModelError, naming it."""
    import keras

    builder = _import_builder(spec.builder)
    with users_code(spec.name, "failed to build its model"):
        model = builder(info) if spec.is_users else builder(info, width, **options)
    contract.check_is_model(spec.name, model)
    ignored = contract.ignored_by_the_run(model, spec.name)  # of the model as its user made it
    model, note = softmax.drop_final_softmax(model, spec.name)
    contract.check_contract(spec.name, model, info, batch_size if spec.is_users else None)
    if notes is not None:
        notes.extend(filter(None, [note, ignored]))
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            # Statistics over the global batch: N replicas train like one.
            layer.synchronized = True
    return model


def parameter_count(spec: ModelSpec, info, width: int = 64, **options):
    """How many weights `spec`'s network has for dataset `info`, counted before any exists:
    its layers are declared in a graph never run, which allocates no weight (resnet9 at
    width 1,024: 1.7 billion weights counted in well under a second, 0.4 GB, not 6.8). None
    for a user's network: their function is called once, by build_model."""
    if spec.is_users:
        return None
    import math
    import random

    import tensorflow as tf

    # airbench's identity initialization reads and sets its filters' values:
    # it needs weights that exist, and changes no shape.
    if "identity_init" in spec.options:
        options = {**options, "identity_init": False}
    # Keras draws each initializer's seed from Python's generator: put it
    # back, so that the model built next is the one built without a count.
    state = random.getstate()
    try:
        with tf.Graph().as_default():
            model = _import_builder(spec.builder)(info, width, **options)
            return sum(math.prod(weight.shape) for weight in model.weights)
    finally:
        random.setstate(state)


def initialize_from_data(model, train_images, name: str = "") -> None:
    """Lets every layer that derives weights from the training data (an
    `initialize_from_data` method: airbench's whitening) compute them;
    what one raises is a ModelError naming --model=`name`."""
    for layer in model._flatten_layers(include_self=False):
        if hasattr(layer, "initialize_from_data"):
            with users_code(name or model.name, "failed to initialize from the training images"):
                layer.initialize_from_data(train_images)


def split_at_normalization(model, name: str):
    """(the layer named "normalize" that `model` applies to its uint8 input
    first, a model of the same variables from that layer's output to the
    logits): where color jitter of the normalized image goes in. Built-in
    models start with `layers.normalized_input`; a user's model without
    such a layer raises ModelError (`name`: its --model)."""
    import keras

    try:
        normalize = model.get_layer("normalize")
        if normalize.input is not model.inputs[0]:
            raise ValueError("its input is not the model's")
        # Named as the model, whose scope is then the rest's too: what fails
        # in it is blamed on the model (blame.py) as in a step without jitter.
        return normalize, keras.Model(normalize.output, model.output, name=model.name)
    except Exception as e:  # noqa: BLE001 - no such layer, or a model Keras cannot cut there
        raise ModelError(
            f"--model={quoted(name)}: color jitter (--brightness_jitter, --contrast_jitter) "
            f"needs a functional model whose first layer after its uint8 input is a "
            f"Normalization named 'normalize' (layers.normalized_input), and this one has none "
            f"({type(e).__name__}: {quoted(first_line(e))}); drop the jitter flags") from None


def take_crops(model, crop_size: int, image_shape, name: str, parts=()) -> None:
    """Lets `model`, and the `parts` cut from it (split_at_normalization's),
    train on square crops of `crop_size` pixels (--early_crop_size) as well
    as on the `image_shape` it was built for.

    Keras checks a functional model's input against the shape of its
    `keras.Input`; convolutions and global pooling take any size, but a
    model whose layers need the built size (the mlp's Flatten before a
    Dense) raises ModelError naming --model=`name`; a crop no smaller
    than the images, or images that are not square, ConfigError."""
    import keras
    import numpy as np

    height, width, channels = image_shape
    if height != width:
        # The pipeline draws a crop's corner from one range for both axes.
        raise ConfigError(f"--early_crop_size needs square images, and these are "
                          f"{height}x{width}")
    if not 0 < crop_size < height:
        raise ConfigError(f"--early_crop_size={crop_size} must be smaller than the "
                          f"{height}x{width} images")
    for functional in (model, *parts):
        if getattr(functional, "inputs", None):  # relax its check to any height and width
            functional.input_spec = [keras.InputSpec(shape=(None, None, None, channels),
                                                     allow_last_axis_squeeze=True)]

    def output_shape(height, width):
        # Called, not traced symbolically: Keras checks each layer's input
        # only in a call (a Dense fed 1,728 values for 3,072 passes a trace).
        images = np.zeros((1, height, width, channels), np.uint8)
        return list(keras.ops.shape(model(images, training=False)))

    try:
        whole, cropped = output_shape(height, width), output_shape(crop_size, crop_size)
        if cropped != whole:
            raise ValueError(f"its output is {cropped}, not {whole} as for whole images")
    except Exception as e:  # noqa: BLE001 - a user's model may fail in any way
        raise ModelError(
            f"--model={quoted(name)} cannot train on crops of {crop_size}x{crop_size} pixels "
            f"({type(e).__name__}: {quoted(first_line(e), 200)}): its layers need the "
            f"{height}x{width} images; drop --early_crop_size, or end the model's convolutions "
            f"with a global pooling") from None


def has_batch_norm(model) -> bool:
    """Whether `model` all-reduces inside its forward pass when replicas
    train together (synchronized batch norm), which XLA-compiling a
    replica's step cannot hold."""
    import keras

    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers(include_self=False))


def _locate(source: str) -> Tuple[str, str]:
    """(the file, the function name) of a user's model source; ModelError
    for a module that is not found."""
    where, _, function = source.rpartition(":")
    if _FILE_SOURCE.fullmatch(source):
        return os.path.abspath(os.path.expanduser(where)), function
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError) as e:
        raise ModelError(f"--model={quoted(source)}: cannot find module {quoted(where)} "
                         f"({quoted(first_line(e))})") from None
    if spec is None or not spec.origin:
        raise ModelError(f"--model={quoted(source)}: no module {quoted(where)} on the Python path")
    return spec.origin, function


def _import_builder(builder: str):
    """The function `builder` ("module:function" or "file.py:function")."""
    where, _, function = builder.rpartition(":")
    with users_code(builder, "does not import"):
        path = _locate(builder)[0]
        if path.endswith(".py"):  # a module's source too: importing it compiles it
            contract.check_source(builder, path)
        if _FILE_SOURCE.fullmatch(builder):
            # As for a script, the modules beside it are importable: after the
            # installed ones, which a file of the same name there must not replace.
            if os.path.dirname(path) not in sys.path:
                sys.path.append(os.path.dirname(path))
            name = "distributed_mpt_user_model_" + hashlib.sha1(path.encode()).hexdigest()[:8]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        found = getattr(module, function, None)  # a module's __getattr__ is code too
    if not callable(found):
        what = "" if found is None else f" ({quoted(function)} is {type(found).__name__!r})"
        raise ModelError(f"--model={quoted(builder)}: {quoted(where)} has no function "
                         f"{quoted(function)}{what}")
    return found
