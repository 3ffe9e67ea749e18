"""Metric state summed over the ranks, on every backend: one flat vector of increments, cut back after the sum.

Each rank's increments (and the other numbers a step logs) travel as one flat vector.

A step starts every metric variable at zero, so after it the variables hold the rank's increments.
The backend step sums `flat(...)`'s vector over the ranks in one collective and adds each piece to
the state the metric had before the step.
"""

import numpy as np
from keras import ops


def flat(values, dtype, weights=None):
    """`values` (arrays of any shape) as one flat vector of `dtype`; with `weights`, each value
    times its weight (a scalar)."""
    weights = weights or [None] * len(values)
    parts = [ops.reshape(ops.cast(value, dtype), [-1]) for value in values]
    return ops.concatenate([part if weight is None else part * ops.cast(weight, dtype)
                            for part, weight in zip(parts, weights)])


def pieces(summed, like):
    """`summed` (the sum over ranks of `flat(...)`'s vector) cut into arrays with the static shapes
    and the dtypes of `like`, in order."""
    shapes = [tuple(value.shape) for value in like]
    offsets = np.cumsum([int(np.prod(shape)) for shape in shapes])[:-1].tolist()
    cut = ops.split(summed, offsets) if offsets else [summed]
    return [ops.cast(ops.reshape(piece, shape), value.dtype) for piece, shape, value in zip(cut, shapes, like)]
