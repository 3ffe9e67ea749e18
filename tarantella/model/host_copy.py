"""A copy of a Keras model and its optimizer in host memory, from which a thread writes checkpoints.

ModelCheckpoint wrapped with `write_in_background=True` (tnt.keras.callbacks.Callback): at a
checkpoint the step only snapshots the variables (`Step.snapshot`); a thread puts the values into
this copy and has Keras write the file from it while training goes on, so Keras' serialization,
most of a checkpoint's time, leaves the step. The copy is built once per model, as
`keras.models.load_model` builds one (from the config serial Keras would save), on the CPU; it
costs the master the host memory of the model's variables and optimizer state, twice (the copy and
the snapshot).

Only models of Keras' own classes (Functional, Sequential) are copied: for those, the variables
listed here are all that Keras writes. A subclassed model may hold more (a second optimizer, state
of its own), which a copy could miss without notice; it is written on the step instead.
"""

import logging
import time
import weakref

import keras
import numpy as np

from tarantella import backends
from tarantella.model import batch_normalization

logger = logging.getLogger("tarantella")

_copies = weakref.WeakKeyDictionary()  # Keras model -> its HostCopy, or None where it has none


class HostCopy:
    """`model` and its optimizer rebuilt on the CPU, its variables paired with the model's."""

    def __init__(self, model):
        with batch_normalization.configs_as_serial_keras_writes(model), keras.device("cpu:0"):
            copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
            if model.compiled:
                copy.compile_from_config(model.get_compile_config())
                if model.optimizer is not None and model.optimizer.built:
                    copy.optimizer.build(copy.trainable_variables)
        self.model = copy
        self._originals = _state(model)
        self._copies = _state(copy)
        self._host_arrays = None  # the last snapshot's host arrays, reused by the next
        here, there = [describe(v) for v in self._originals], [describe(v) for v in self._copies]
        if here != there:
            raise ValueError(f"the copy's variables differ from the model's: "
                             f"{first_difference(here, there, 'in the model', 'in the copy')}")

    def copies(self, model):
        """Whether this copy still pairs with `model`'s variables (a recompiled model has others)."""
        return [id(v) for v in _state(model)] == [id(v) for v in self._originals]

    def snapshot(self):
        """The model's state now, for `fill` (on the step; one snapshot in use at a time)."""
        values = backends.step_class().snapshot(self._originals, self._host_arrays)
        self._host_arrays = values if all(isinstance(value, np.ndarray) for value in values) else None
        return values

    def fill(self, values):
        """Gives the copy the values of a snapshot (in the writing thread)."""
        for variable, value in zip(self._copies, values):
            variable.assign(np.asarray(value))


def frozen_write(model, write_model):
    """A function of a path that writes `model` as it is now, with `write_model(keras_model, path)`,
    from the host copy: it may run in another thread while training goes on. None where `model`
    has no host copy (then the caller writes on the step)."""
    if model not in _copies or (_copies[model] is not None and not _copies[model].copies(model)):
        _copies[model] = _built_for(model)
    copy = _copies[model]
    if copy is None:
        return None
    values = copy.snapshot()

    def write(path):
        copy.fill(values)
        write_model(copy.model, path)
    return write


def _built_for(model):
    if type(model).__module__.split(".")[0] != "keras":
        logger.info("%s is a subclassed model: its checkpoints are written by Keras on the step, and only "
                    "copied into place in the background.", type(model).__name__)
        return None
    started = time.monotonic()
    try:
        copy = HostCopy(model)
        logger.debug("host copy of %s for checkpoints built in %.3f s", model.name, time.monotonic() - started)
        return copy
    except Exception as error:  # any model Keras cannot rebuild from its config keeps the step's write
        logger.warning("No host copy of %s for writing checkpoints in the background (%s); Keras writes them "
                       "on the step, and they are only copied into place in the background.", model.name, error)
        return None


def _state(model):
    """The model's variables, then its optimizer's, each once."""
    state, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    for variable in [*model.variables, *(optimizer.variables if optimizer is not None else [])]:
        if id(variable) not in seen:
            seen.add(id(variable))
            state.append(variable)
    return state


def describe(variable):
    """[path, dtype, shape]: what a file's variable must match to be read into `variable`."""
    return [getattr(variable, "path", variable.name), str(np.dtype(variable.dtype)), list(variable.shape)]


def first_difference(these, those, these_name, those_name):
    """Where two lists of `describe`d variables first differ, in words."""
    for index, (this, that) in enumerate(zip(these, those)):
        if this != that:
            return f"variable #{index} is {this} {these_name} but {that} {those_name}"
    return f"{len(these)} variables {these_name}, {len(those)} {those_name}"
