"""`tnt.models`: saving and loading whole models, like `keras.models`, but as tnt.Models.

Saves are written by the master (see saving.py); every rank loads, so a loaded file must be
visible to all ranks (a shared file system). Saved files are plain Keras files.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from tarantella import saving
from tarantella.model import Model, batch_normalization, host_copy

__all__ = ["clone_model", "load_model", "model_from_config", "model_from_json", "save_model"]


def save_model(model: keras.Model, filepath: str | os.PathLike, overwrite: bool = True,
               tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
    """Saves a tnt.Model or a keras.Model as a .keras file, written by the master only.

    Call it on every rank: each returns once the file is complete.

    Args:
        model: the tnt.Model or keras.Model to save.
        filepath: where to write the `.keras` file.
        overwrite: False refuses to replace an existing file.
        tnt_save_all_devices: True makes every rank write, for file systems the ranks do not share.
        **kwargs: passed on to `keras.Model.save`.

    Raises:
        TypeError: `model` is no keras.Model.
        FileExistsError: `overwrite=False` and the file exists.
    """
    if isinstance(model, Model):
        return model.save(filepath, overwrite=overwrite, tnt_save_all_devices=tnt_save_all_devices, **kwargs)
    if not isinstance(model, keras.Model):
        raise TypeError(f"save_model saves a keras.Model or tnt.Model; got {type(model).__name__}.")
    saving.write_whole(filepath, lambda partial: batch_normalization.save_as_serial_keras(model, partial, **kwargs),
                       overwrite, tnt_save_all_devices,
                       frozen_write=lambda: host_copy.frozen_write(model, lambda copy, path: copy.save(path, **kwargs)))


def load_model(filepath: str | os.PathLike, custom_objects: dict[str, Any] | None = None, compile: bool = True,
               safe_mode: bool = True, synchronized_batch_normalization: bool = False) -> Model:
    """Loads a saved model as a tnt.Model, compiled (with its optimizer state) if it was saved so.

    Every rank reads the file, so it must be visible to all of them.

    Args:
        filepath: the saved model (a `.keras` file).
        custom_objects: the user's classes and functions the model needs, by name.
        compile: False loads the model uncompiled.
        safe_mode: as in `keras.models.load_model` (False allows loading lambdas).
        synchronized_batch_normalization: as for `tnt.Model`. A saved file holds the layers as
            serial Keras has them, so a model trained with synchronized BatchNormalization asks
            for it again here.

    Returns:
        tarantella.Model: the loaded model.
    """
    keras_model = keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                          safe_mode=safe_mode)
    return _wrap(keras_model, synchronized_batch_normalization)


def model_from_config(config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> Model:
    """A new tnt.Model from `model.get_config()`; weights are freshly initialized.

    Args:
        config: the `get_config()` of a functional or Sequential model, or a serialized model.
        custom_objects: the user's classes and functions the model needs, by name.

    Returns:
        tarantella.Model: the new model.
    """
    return Model.from_config(config, custom_objects)


def model_from_json(json_string: str, custom_objects: dict[str, Any] | None = None) -> Model:
    """A new tnt.Model from `model.to_json()`; weights are freshly initialized.

    Args:
        json_string: the model's `to_json()`.
        custom_objects: the user's classes and functions the model needs, by name.

    Returns:
        tarantella.Model: the new model.
    """
    return _wrap(keras.models.model_from_json(json_string, custom_objects=custom_objects))


def clone_model(model: keras.Model, **kwargs: Any) -> Model:
    """A tnt.Model with the same architecture and new weights (see keras.models.clone_model).

    Args:
        model: the tnt.Model or keras.Model to clone.
        **kwargs: passed on to `keras.models.clone_model`.

    Returns:
        tarantella.Model: the clone.
    """
    keras_model = model._keras_model if isinstance(model, Model) else model
    with batch_normalization.configs_as_serial_keras_writes(keras_model):
        clone = keras.models.clone_model(keras_model, **kwargs)
    return Model(clone)


def _wrap(keras_model, synchronized_batch_normalization=False):
    model = Model(keras_model, synchronized_batch_normalization=synchronized_batch_normalization)
    if keras_model.compiled:
        arguments = keras.saving.deserialize_keras_object(keras_model.get_compile_config())
        arguments["optimizer"] = keras_model.optimizer  # keeps the loaded optimizer state
        model.compile(**arguments)
    return model
