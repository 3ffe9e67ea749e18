"""Synchronized BatchNormalization in tnt.Model: switching a model's layers to it, and the flag that
their saved configs carry instead, the one serial Keras writes for the user's own model."""

import contextlib

import keras

from tarantella import backends

# Marks a layer that tarantella switched to `synchronized`, as against one the user switched.
_SWITCHED_BY_TARANTELLA = "_tarantella_synchronized"


def synchronize(model):
    """Makes every BatchNormalization layer of `model` normalize with the global batch's moments:
    each backend's step computes them for the layers whose `synchronized` is True."""
    for layer in _batch_normalization_layers(model):
        if not layer.synchronized:
            layer.synchronized = True
            setattr(layer, _SWITCHED_BY_TARANTELLA, True)


@contextlib.contextmanager
def configs_as_serial_keras_writes(model):
    """Inside: `model`'s BatchNormalization layers have the `synchronized` flag that serial Keras
    would save for the user's model, so that a saved file or config loads wherever serial Keras'
    would. tarantella's switch is no part of the user's model, and Keras refuses to build a layer
    with `synchronized=True` on any backend but TensorFlow, whatever set the flag (on JAX and torch
    a user sets the attribute for tarantella). The steps read the flag only while they run or are
    traced, never while a model is saved."""
    keeps_the_users_flag = backends.step_class().keras_accepts_synchronized_batch_normalization
    cleared = [layer for layer in _batch_normalization_layers(model) if layer.synchronized and
               (not keeps_the_users_flag or getattr(layer, _SWITCHED_BY_TARANTELLA, False))]
    for layer in cleared:
        layer.synchronized = False
    try:
        yield
    finally:
        for layer in cleared:
            layer.synchronized = True


def save_as_serial_keras(model, filepath, **kwargs):
    """`model.save(filepath, **kwargs)`, writing the configs serial Keras would write."""
    with configs_as_serial_keras_writes(model):
        model.save(filepath, **kwargs)


def _batch_normalization_layers(model):
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
