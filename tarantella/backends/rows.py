"""A micro-batch with at least one row, on every backend: the zero row a rank without samples steps on.

A rank without samples (a global batch smaller than the number of ranks) runs its step on one zero
row, which contributes nothing.

The JAX and torch steps see static shapes and call `at_least_one_row`; the TensorFlow step, traced
once for batches of any size, puts the same `zero_row`s behind a graph conditional
(backends/tensorflow/step.py).
"""

import keras


def is_batched(leaf):
    """Whether a leaf of a batch has rows (a scalar, or a value that is no array, has none)."""
    return len(getattr(leaf, "shape", ())) > 0


def zero_row(leaf):
    """One row of zeros shaped as the rows of `leaf` (dynamic dimensions included), of its dtype."""
    return keras.ops.zeros((1, *keras.ops.shape(leaf)[1:]), dtype=leaf.dtype)


def at_least_one_row(data):
    """The batch `data` (a structure of arrays with static shapes) and its number of rows m; with
    m == 0 every batched array becomes one zero row."""
    batched = [leaf for leaf in keras.tree.flatten(data) if is_batched(leaf)]
    samples = int(batched[0].shape[0]) if batched else 1
    if samples > 0:
        return data, samples
    return keras.tree.map_structure(lambda leaf: zero_row(leaf) if is_batched(leaf) else leaf, data), 0


def non_trainable_after_step(model, samples, before, after):
    """The values of `model.non_trainable_variables` after a step on the rank's `samples` rows that
    took them from `before` to `after` (JAX's stateless step). A rank without samples keeps its
    non-trainable weights as they were (BatchNormalization's moving statistics, which its zero row
    would move) and takes the rest: its seed generators' states advance as every rank's do, by one per
    draw, so that later draws stay alike on every rank (backends/batch_draws.py)."""
    if samples:
        return list(after)
    kept = _kept_without_samples(model)
    return [old if id(variable) in kept else new
            for variable, old, new in zip(model.non_trainable_variables, before, after)]


def restore_without_samples(model, before):
    """After a step in place (torch's) on a rank without samples: the non-trainable weights take back
    their values `before` the step, as in `non_trainable_after_step`."""
    kept = _kept_without_samples(model)
    for variable, value in zip(model.non_trainable_variables, before):
        if id(variable) in kept:
            variable.assign(value)


def _kept_without_samples(model):
    return {id(weight) for weight in model.non_trainable_weights}
