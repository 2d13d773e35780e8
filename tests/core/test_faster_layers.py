"""A model saved with the faster layers in it (`model.save`, not an export,
which holds Keras' own layers) loads after their module's rename: Keras
finds each class by the name the file records, in the `custom_objects` it
is given, and never reads the module the file names."""

import json
import zipfile

import keras
import numpy as np

from distributed_mpt.core.models.faster_layers import (CompiledActivation, FusedBatchNormalization,
                                                       SideBySideConv2D)

# The module's name until issue 42, as a file saved then records it.
OLD_MODULE = "distributed_mpt.core.models.cpu_layers"
# What such a file records for each layer (its registered_name, read from a
# file the old module wrote with Keras 3.15): the class's own name.
RECORDED = {"SideBySideConv2D": SideBySideConv2D, "FusedBatchNormalization": FusedBatchNormalization,
            "CompiledActivation": CompiledActivation}


def test_the_layers_are_registered_under_the_names_older_files_record():
    assert {keras.saving.get_registered_name(cls): cls for cls in RECORDED.values()} == RECORDED


def _as_saved_before_the_rename(path, saved):
    """Writes `saved` (a .keras file) to `path` with every layer of this
    package naming the old module, as the old module's files do."""
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(path, "w") as copy:
        for entry in source.infolist():
            data = source.read(entry)
            if entry.filename == "config.json":
                config = json.loads(data)
                for layer in config["config"]["layers"]:
                    if layer["class_name"] in RECORDED:
                        assert layer["module"] == SideBySideConv2D.__module__
                        layer["module"] = OLD_MODULE
                data = json.dumps(config).encode()
            copy.writestr(entry, data)


def test_a_model_saved_when_the_module_had_another_name_loads_and_computes_the_same(tmp_path):
    keras.utils.set_random_seed(0)
    images = keras.Input((5, 5, 2))
    x = SideBySideConv2D(3, 3, padding="same", name="conv")(images)
    x = FusedBatchNormalization(name="norm")(x)
    model = keras.Model(images, CompiledActivation("gelu", name="gelu")(x))
    model.save(tmp_path / "new.keras")
    _as_saved_before_the_rename(tmp_path / "old.keras", tmp_path / "new.keras")
    recorded = json.loads(zipfile.ZipFile(tmp_path / "old.keras").read("config.json"))
    assert {(layer["module"], layer["registered_name"]) for layer in recorded["config"]["layers"]
            if layer["class_name"] in RECORDED} == {(OLD_MODULE, name) for name in RECORDED}

    loaded = keras.saving.load_model(tmp_path / "old.keras", custom_objects=RECORDED)
    assert [type(layer) for layer in loaded.layers[1:]] == [SideBySideConv2D, FusedBatchNormalization,
                                                            CompiledActivation]
    inputs = np.random.default_rng(0).normal(size=(4, 5, 5, 2)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(loaded(inputs)), np.asarray(model(inputs)), rtol=1e-6)
