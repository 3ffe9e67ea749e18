"""Synchronized BatchNormalization's arithmetic on every backend: moment sums, and the global moments from them.

Each rank takes its micro-batch's two-pass moments (16-bit inputs in float32, as Keras does), and
sends (n * mean, n * (variance + mean^2), n) per channel. The sums give the global mean and
variance without the cancellation of a float32 sum of squares where the sums are float64. How the
sum over ranks runs, and its gradient (the sum over ranks of the incoming gradients), is the
backend step's glue.
"""

import keras
from keras import ops

from tarantella.backends.fusion import SIXTEEN_BIT_FLOATS


def local_sums(x, axes, dtype, contributes):
    """The rank's sums of `x` over `axes` as one flat vector of `dtype`, the moments' shape (with
    the reduced axes kept) and the axes, made non-negative. Where `contributes` is False (a rank without samples, whose
    zero row may give NaN), the vector is zeros, still computed from `x` so that a backward pass
    through it runs as on the other ranks."""
    if keras.backend.standardize_dtype(x.dtype) in SIXTEEN_BIT_FLOATS:
        x = ops.cast(x, "float32")
    axes = [axis % len(x.shape) for axis in ([axes] if isinstance(axes, int) else axes)]
    # Two passes on every backend (Keras' own torch `moments` takes E[x^2] - E[x]^2, which cancels).
    mean, variance = ops.mean(x, axis=axes, keepdims=True), ops.var(x, axis=axes, keepdims=True)
    mean, variance = ops.cast(mean, dtype), ops.cast(variance, dtype)
    count = 1
    for axis in axes:
        count = count * ops.shape(x)[axis]  # a tensor where the batch size is dynamic
    count = ops.cast(count, dtype) * ops.ones_like(mean)
    flat = ops.concatenate([ops.reshape(t, [-1]) for t in (count * mean, count * (variance + ops.square(mean)),
                                                            count)])
    return ops.where(contributes, flat, ops.zeros_like(flat)), ops.shape(mean), axes


def global_moments(summed, shape, axes, keepdims, dtype):
    """The global batch's mean and variance (of `dtype`) from `summed`, the sum over ranks of
    `local_sums`' vectors."""
    total, squares, count = [ops.reshape(piece, shape) for piece in ops.split(summed, 3)]
    # Plain operators and `where`: Keras' torch divide_no_nan and maximum return float32 for float64.
    count = ops.where(count > 0, count, ops.ones_like(count))
    mean = total / count
    variance = squares / count - ops.square(mean)
    variance = ops.where(variance > 0, variance, ops.zeros_like(variance))
    mean, variance = ops.cast(mean, dtype), ops.cast(variance, dtype)
    if not keepdims:
        mean, variance = ops.squeeze(mean, axis=tuple(axes)), ops.squeeze(variance, axis=tuple(axes))
    return mean, variance
