"""Which compiled losses the share weighting makes global on the JAX backend.

Weighting a rank's loss by its share m/B gives the serial loss when the loss is a mean over
the micro-batch's entries. A mask (an output mask such as `mask_zero=True`'s, or
`ignore_class`), `reduction="sum"`, or `reduction="mean_with_sample_weight"` with weights
divides by something else, which the TensorFlow step makes global with one more allreduce
(distributed_step._GlobalLossTerm; on torch, torch_step._GlobalLossTerm). The JAX step does not
have that yet, so such a loss is refused there instead of training to a result that differs
from serial Keras.
"""

import contextlib

# Keras reduces a loss under its mask and sample weights in this private function;
# tests/test_keras_internals.py checks it.
from keras.src.losses import loss as keras_loss

_MEAN_REDUCTIONS = ("mean", "sum_over_batch_size")


@contextlib.contextmanager
def only_means_over_entries(backend):
    """While a step is traced or runs on `backend`: a loss reduction that is not a mean over the
    micro-batch's entries raises NotImplementedError, on every rank alike."""
    original = keras_loss.reduce_weighted_values

    def checked(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
        why = _why_not_a_mean_over_entries(values, sample_weight, mask, reduction)
        if why is not None:
            raise NotImplementedError(
                f"{why} is not supported on Keras' {backend} backend with several ranks yet: its value "
                "would differ from serial Keras'. Use a loss that is a mean over the batch (no mask, "
                "reduction='sum_over_batch_size'), or the TensorFlow backend, where it is supported.")
        return original(values, sample_weight, mask, reduction, dtype)

    keras_loss.reduce_weighted_values = checked
    try:
        yield
    finally:
        keras_loss.reduce_weighted_values = original


def _why_not_a_mean_over_entries(values, sample_weight, mask, reduction):
    if len(getattr(values, "shape", ())) == 0:
        return None  # Keras returns a scalar as it is
    if reduction == "sum":
        return "A loss with reduction='sum'"
    if reduction in _MEAN_REDUCTIONS and mask is not None:
        return "A masked loss (an output mask, e.g. from mask_zero=True, or a loss's ignore_class)"
    if reduction == "mean_with_sample_weight" and (sample_weight is not None or mask is not None):
        return "A loss with reduction='mean_with_sample_weight' and sample weights or a mask"
    return None
