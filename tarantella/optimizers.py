"""Custom training loops: every rank applies the serial update of the global batch, on every backend.

Each rank differentiates the loss of its micro-batch. For a loss averaged over the
micro-batch ("mean", Keras' default), the serial gradient of the global batch B is
    sum over ranks r of (m_r / B) * g_r,   B = sum of m_r,
where m_r is rank r's number of samples. Each rank sends m_r * g_r together with m_r in
the same fused allreduce, and divides the two sums: one collective round gives B and the
serial gradient, also when micro-batches differ in size (an uneven last batch). For a loss
summed over the micro-batch ("sum") the serial gradient is the plain sum of the g_r.

Each backend's step does the arithmetic on its own arrays (`Step.sum_loop_gradients`): TensorFlow
eagerly or inside a `tf.function`; JAX on its arrays, also inside `jax.jit` (an ordered host
callback hands the round to the communicator's worker thread); torch on its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import keras
import tensorflow as tf

from tarantella import backends
from tarantella.backends import fusion
from tarantella.common import config
from tarantella.runtime import world

__all__ = ["Optimizer", "allreduce_gradients"]

_LOSS_REDUCTIONS = ("mean", "sum")


def _refuse_where_the_backend_lacks_custom_training_loops():
    step = backends.step_class()
    step.refuse_unless(
        "custom_training_loops", "tnt.optimizers (allreduce_gradients, Optimizer)",
        instead=f"On {step.backend_name}, train with tnt.Model's fit, or use the TensorFlow backend for custom "
                "training loops.")


def allreduce_gradients(grads: Sequence[Any], num_samples: int | Any | None = None,
                        loss_reduction: Literal["mean", "sum"] = "mean",
                        variables: Sequence[tf.Variable | keras.Variable] | None = None) -> list[Any]:
    """Returns the gradients of the global batch's loss from this rank's `grads`, on every rank.

    With `loss_reduction="mean"`, each rank's gradient is weighted by its share of the global
    batch; without `num_samples` all ranks weigh alike, which is exact only when every
    micro-batch has the same size. With `loss_reduction="sum"` the gradients are summed;
    `num_samples` only serves to ignore ranks with no samples. A rank with `num_samples=0`
    contributes exactly zero, even if its gradient is NaN. The gradients travel as
    TNT_GRADIENT_WIRE says (by default exactly, unless they are all of one 16-bit type).

    Args:
        grads: this rank's gradients, a list aligned with the variables (None entries stay None):
            TensorFlow tensors, JAX arrays (also inside `jax.jit`) or torch tensors, as the backend
            computes them.
        num_samples: the number of samples this rank's loss was computed on (its micro-batch
            size, e.g. `tf.shape(x)[0]`, `x.shape[0]` or `len(x)`).
        loss_reduction: `"mean"` for a loss averaged over the micro-batch (Keras' default),
            `"sum"` for a loss summed over it.
        variables: the variables, aligned with `grads`: they give each gradient its variable's
            shape, for gradients whose static shape TensorFlow left partly unknown (Dense on
            3-D inputs).

    Returns:
        The gradients of the global batch, aligned with `grads`, the same on every rank, in the
        backend's arrays.

    Raises:
        ValueError: `loss_reduction` is neither "mean" nor "sum".
    """
    _refuse_where_the_backend_lacks_custom_training_loops()
    if loss_reduction not in _LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}: use 'mean' for a loss averaged over the batch "
                         "(Keras' default) or 'sum' for a loss summed over it.")
    comm = world.init()
    if comm.size == 1 or all(g is None for g in grads):
        return list(grads)
    wire = fusion.gradient_wire(config.gradient_wire(),
                                [keras.backend.standardize_dtype(g.dtype) for g in grads if g is not None])
    return backends.step_class().sum_loop_gradients(
        list(grads), num_samples, loss_reduction, None if variables is None else list(variables),
        world.gradient_reducer(wire), backends.fusion_threshold_bytes(), comm.size)


class Optimizer:
    """Wraps a Keras optimizer for a custom training loop on several ranks.

    `apply`, `apply_gradients` and, on JAX, `stateless_apply` first combine the ranks' gradients
    with `allreduce_gradients` (pass `num_samples=`, the rank's micro-batch size), then run the
    wrapped optimizer's update, the same on every rank. Everything else (`variables`,
    `learning_rate`, `iterations`, `build`, ...) is the wrapped optimizer's.

    Args:
        optimizer: a Keras optimizer (an object, a name or a config, as `keras.optimizers.get`
            takes).
        loss_reduction: `"mean"` for a loss averaged over the micro-batch (Keras' default),
            `"sum"` for a loss summed over it.

    Raises:
        TypeError: `optimizer` is a tnt.optimizers.Optimizer already.
        ValueError: `loss_reduction` is neither "mean" nor "sum".
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer | str | dict[str, Any],
                 loss_reduction: Literal["mean", "sum"] = "mean") -> None:
        _refuse_where_the_backend_lacks_custom_training_loops()
        if isinstance(optimizer, Optimizer):
            raise TypeError("This optimizer is already a tnt.optimizers.Optimizer; wrap the Keras optimizer once.")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction={loss_reduction!r}: use 'mean' for a loss averaged over the batch "
                             "(Keras' default) or 'sum' for a loss summed over it.")
        object.__setattr__(self, "_optimizer", keras.optimizers.get(optimizer))
        object.__setattr__(self, "_loss_reduction", loss_reduction)

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The wrapped Keras optimizer."""
        return self._optimizer

    def apply(self, grads: Sequence[tf.Tensor | None],
              trainable_variables: Sequence[tf.Variable | keras.Variable] | None = None,
              num_samples: int | tf.Tensor | None = None) -> None:
        """Combines the ranks' gradients, then applies the wrapped optimizer's update.

        Args:
            grads: this rank's gradients, aligned with `trainable_variables`.
            trainable_variables: the variables to update (as in `keras.optimizers.Optimizer.apply`).
            num_samples: the number of samples this rank's loss averages over, e.g.
                `tf.shape(x)[0]`; it makes the update exact for uneven micro-batches.
        """
        variables = list(trainable_variables) if trainable_variables is not None else None
        combined = allreduce_gradients(list(grads), num_samples, self._loss_reduction, variables)
        return self._optimizer.apply(combined, trainable_variables)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[tf.Tensor | None, tf.Variable | keras.Variable]],
                        num_samples: int | tf.Tensor | None = None) -> keras.Variable:
        """`apply` for (gradient, variable) pairs, as `keras.optimizers.Optimizer.apply_gradients`.

        Args:
            grads_and_vars: (gradient, variable) pairs of this rank.
            num_samples: the number of samples this rank's loss averages over, as in `apply`.

        Returns:
            keras.Variable: the wrapped optimizer's `iterations`, the number of updates so far.
        """
        grads, variables = zip(*grads_and_vars)
        combined = allreduce_gradients(list(grads), num_samples, self._loss_reduction, list(variables))
        return self._optimizer.apply_gradients(zip(combined, variables))

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any], num_samples: int | Any | None = None) -> tuple[list, list]:
        """`keras.optimizers.Optimizer.stateless_apply` (a JAX training step's, also inside `jax.jit`),
        after combining the ranks' gradients.

        Args:
            optimizer_variables: the optimizer's variable values, as Keras takes them.
            grads: this rank's gradients, aligned with `trainable_variables`.
            trainable_variables: the values of the variables to update.
            num_samples: the number of samples this rank's loss averages over, as in `apply`.

        Returns:
            The updated trainable values and optimizer variable values, as Keras returns them.
        """
        combined = allreduce_gradients(list(grads), num_samples, self._loss_reduction)
        return self._optimizer.stateless_apply(optimizer_variables, combined, trainable_variables)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._optimizer, name, value)  # e.g. optimizer.learning_rate = 0.01
