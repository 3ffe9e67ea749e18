"""Compiled losses that are not a mean over the micro-batch's entries, made global on every backend.

Weighting a rank's loss by its share m/B gives the serial loss when the loss is a mean over
the micro-batch's entries. A mask (an output mask such as `mask_zero=True`'s, or
`ignore_class`), `reduction="sum"`, or `reduction="mean_with_sample_weight"` with weights
divides by something else. `global_loss_terms` makes such a loss global: the rank's divisor is
summed over ranks and the value rescaled. The arithmetic is float32, the dtype of Keras' own loss
reduction (docs/architecture.md, "One dtype for the loss terms"); the sum over ranks is the
step's: an op of the traced step on TensorFlow, an ordered callback inside the jitted step on
JAX, a collective of its own while the loss is computed on torch.
"""

import contextlib

from keras import ops
# Keras reduces a loss under its mask and sample weights in this private function;
# tests/test_keras_internals.py checks it.
from keras.src.losses import loss as keras_loss

_MEAN_REDUCTIONS = ("mean", "sum_over_batch_size")

# The dtype of the divisors and factors: float32, as Keras' own reduction; float64 moved no loss
# closer to serial Keras on any backend (benchmarks/loss_term_dtype.py, docs/architecture.md).
ARITHMETIC_DTYPE = "float32"


@contextlib.contextmanager
def global_loss_terms(compile_loss, inverse_share, sum_over_ranks):
    """While a step is traced: every term of the built `compile_loss`, weighted by the rank's share
    m/B, sums over the ranks to the serial loss. `inverse_share()` returns B/m (0 without samples),
    asked for only where a term needs it (on TensorFlow, asking may open the step);
    `sum_over_ranks(local)` returns the sum of a float32 scalar over the ranks.
    Without a built compiled loss (a model compiled without one) nothing changes."""
    terms = getattr(compile_loss, "_flat_losses", None)  # Keras private; tests/test_keras_internals.py checks it
    if not terms:
        yield
        return
    originals = list(terms)
    terms[:] = [term._replace(loss=_GlobalLossTerm(term.loss, inverse_share, sum_over_ranks))
                for term in originals]
    try:
        yield
    finally:
        terms[:] = originals


class _GlobalLossTerm:
    """One compiled loss, rescaled from the rank's divisor to the global batch's. Keras's
    `Loss.__call__` merges the output's mask, its own (`ignore_class`) and the sample weights and
    hands them to `reduce_weighted_values`, which is replaced during the call: the rank's divisor
    is read from exactly what Keras divides by."""

    def __init__(self, loss, inverse_share, sum_over_ranks):
        self._loss = loss
        self._inverse_share = inverse_share
        self._sum_over_ranks = sum_over_ranks

    def __getattr__(self, name):
        return getattr(self._loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        if getattr(self._loss, "reduction", "sum_over_batch_size") == "sum":
            value = self._loss(y_true, y_pred, sample_weight)
            return value * ops.cast(self._inverse_share(), value.dtype)
        original = keras_loss.reduce_weighted_values

        def reduce_globally(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
            value = original(values, sample_weight, mask, reduction, dtype)
            local = _local_divisor(values, sample_weight, mask, reduction, dtype)
            if local is None:
                return value  # a mean over the micro-batch's entries: the share is the right weight
            inverse_share = ops.cast(self._inverse_share(), ARITHMETIC_DTYPE)
            local = ops.where(inverse_share > 0, local, ops.zeros_like(local))
            total = ops.cast(self._sum_over_ranks(local), ARITHMETIC_DTYPE)
            factor = ops.divide_no_nan(local, total) * inverse_share
            return value * ops.cast(factor, value.dtype)

        keras_loss.reduce_weighted_values = reduce_globally
        try:
            return self._loss(y_true, y_pred, sample_weight)
        finally:
            keras_loss.reduce_weighted_values = original


def _local_divisor(values, sample_weight, mask, reduction, dtype):
    """What Keras's mean reduction divides the micro-batch's summed loss by (ARITHMETIC_DTYPE), or None
    where that is the number of entries, which the rank's share already accounts for."""
    if len(getattr(values, "shape", ())) == 0:
        return None  # Keras returns a scalar unreduced
    if reduction in _MEAN_REDUCTIONS:
        # A mask weights the unmasked entries by entries/unmasked: the mean of the unmasked ones.
        return None if mask is None else ops.sum(ops.cast(mask, ARITHMETIC_DTYPE))
    if reduction == "mean_with_sample_weight":
        as_tensor = lambda t: None if t is None else ops.convert_to_tensor(t, dtype)
        weights = keras_loss.apply_mask(as_tensor(sample_weight), as_tensor(mask), dtype=values.dtype,
                                        reduction=reduction)
        if weights is None:
            return None
        _, weights = keras_loss.squeeze_or_expand_to_same_rank(values, ops.cast(weights, values.dtype))
        return ops.sum(ops.cast(weights, ARITHMETIC_DTYPE))  # Keras divides by the summed weights
    return None  # no reduction
