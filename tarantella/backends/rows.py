"""A micro-batch with at least one row, for the backends whose steps see static shapes (JAX, torch):
a rank without samples (a global batch smaller than the number of ranks) runs its step on one
zero row, which contributes nothing. The TensorFlow step, traced once for batches of any size,
does the same with a graph conditional (backends/tensorflow/step.py)."""

import keras


def at_least_one_row(data):
    """The batch `data` (a structure of arrays) and its number of rows m; with m == 0 every
    batched array becomes one zero row of its dtype."""
    batched = [leaf for leaf in keras.tree.flatten(data) if getattr(leaf, "ndim", 0)]
    samples = int(batched[0].shape[0]) if batched else 1
    if samples > 0:
        return data, samples
    one_zero_row = lambda leaf: (keras.ops.zeros((1,) + tuple(leaf.shape[1:]), dtype=leaf.dtype)
                                 if getattr(leaf, "ndim", 0) else leaf)
    return keras.tree.map_structure(one_zero_row, data), 0
