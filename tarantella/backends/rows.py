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
