"""Metric state summed over the ranks, on every backend: one flat vector of increments, cut back after the sum.

Each rank's increments (and the other numbers a step logs) travel as one flat vector.

A step starts every metric variable at zero, so after it the variables hold the rank's increments.
The backend step sums `flat(...)`'s vector over the ranks in one collective and adds each piece to
the state the metric had before the step.
"""

import types

import numpy as np
from keras import ops

# The array operations the arithmetic below uses: Keras' (inside a traced or jitted step), or
# NumPy's, for a step that sums on the host anyway (torch's eager step: each Keras op on a torch
# tensor costs tens of microseconds, which a step of a small model notices).
KERAS_OPS = types.SimpleNamespace(cast=ops.cast, reshape=ops.reshape, concatenate=ops.concatenate, split=ops.split)
NUMPY = types.SimpleNamespace(cast=lambda value, dtype: np.asarray(value, dtype=dtype), reshape=np.reshape,
                              concatenate=np.concatenate, split=np.split)


def flat(values, dtype, weights=None, xp=KERAS_OPS):
    """`values` (arrays of any shape) as one flat vector of `dtype`; with `weights`, each value
    times its weight (a scalar). `xp`: the array operations (KERAS_OPS or NUMPY)."""
    weights = weights or [None] * len(values)
    parts = [xp.reshape(xp.cast(value, dtype), [-1]) for value in values]
    return xp.concatenate([part if weight is None else part * xp.cast(weight, dtype)
                           for part, weight in zip(parts, weights)])


def pieces(summed, like, xp=KERAS_OPS):
    """`summed` (the sum over ranks of `flat(...)`'s vector) cut into arrays with the static shapes
    and the dtypes of `like`, in order."""
    shapes = [tuple(value.shape) for value in like]
    offsets = np.cumsum([int(np.prod(shape)) for shape in shapes])[:-1].tolist()
    cut = xp.split(summed, offsets) if offsets else [summed]
    return [xp.cast(xp.reshape(piece, shape), value.dtype) for piece, shape, value in zip(cut, shapes, like)]
