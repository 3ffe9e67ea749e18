"""`tnt.models`: saving and loading whole models, like `keras.models`, but as tnt.Models.

Saves are written by the master (see saving.py); every rank loads, so a loaded file must be
visible to all ranks (a shared file system). Saved files are plain Keras files.
"""

import keras

from tarantella import saving
from tarantella.model import Model


def save_model(model, filepath, overwrite=True, tnt_save_all_devices=False, **kwargs):
    """Saves a tnt.Model or a keras.Model as a .keras file, written by the master only."""
    if isinstance(model, Model):
        return model.save(filepath, overwrite=overwrite, tnt_save_all_devices=tnt_save_all_devices, **kwargs)
    if not isinstance(model, keras.Model):
        raise TypeError(f"save_model saves a keras.Model or tnt.Model; got {type(model).__name__}.")
    saving.write_whole(filepath, lambda partial: model.save(partial, **kwargs), overwrite, tnt_save_all_devices)


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """Loads a saved model as a tnt.Model, compiled (with its optimizer state) if it was saved so."""
    keras_model = keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                          safe_mode=safe_mode)
    return _wrap(keras_model)


def model_from_config(config, custom_objects=None):
    """A new tnt.Model from `model.get_config()`; weights are freshly initialized."""
    return Model.from_config(config, custom_objects)


def model_from_json(json_string, custom_objects=None):
    """A new tnt.Model from `model.to_json()`; weights are freshly initialized."""
    return _wrap(keras.models.model_from_json(json_string, custom_objects=custom_objects))


def clone_model(model, **kwargs):
    """A tnt.Model with the same architecture and new weights (see keras.models.clone_model)."""
    keras_model = model._keras_model if isinstance(model, Model) else model
    return Model(keras.models.clone_model(keras_model, **kwargs))


def _wrap(keras_model):
    model = Model(keras_model)
    if keras_model.compiled:
        arguments = keras.saving.deserialize_keras_object(keras_model.get_compile_config())
        arguments["optimizer"] = keras_model.optimizer  # keeps the loaded optimizer state
        model.compile(**arguments)
    return model
