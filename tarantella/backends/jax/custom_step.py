"""A model's own `train_step(self, state, data)` and `test_step(self, state, data)` on Keras' JAX
backend, made global: keras-io's "Customizing what happens in fit() with JAX" and what follows it.

Keras' JAX trainer jits the stateless step it is given. `JaxStep` hands an overridden one the rank's
micro-batch and the state with every metric variable at zero, and while it is traced:

1. the step opens with the sum of the ranks' sample counts m, the global batch size B, and agrees on
   its sequence of collectives (as the built-in step);
2. every optimizer the model holds sums the gradients given to its `stateless_apply` (or to `apply`
   and `apply_gradients` in a StatelessScope of the step's own) over the ranks before the update, each rank's weighted by its share m/B (the loss the user differentiated
   is a mean over the micro-batch, as `compute_loss` and Keras' losses give). Each sum is one round
   of fused buckets (gradient_sums.py), fenced between ordered callbacks, so a step with several
   optimizers (or ones applied twice) sums them in the order it traced them;
3. compiled losses that do not divide by the micro-batch's entries are made global as in the
   built-in step (loss_terms.py);
4. the metric state the step returns holds the rank's increments: they are summed over ranks (a Mean
   fed one scalar per step weighted by the share) and added to the state before; the logs it
   returns are read again from that global state, and any other number becomes its share-weighted
   sum (custom_logs.py);
5. keras.random's draws for the rank's rows (latent vectors, a VAE's epsilon) are its rows of serial
   Keras' draws for the global batch (batch_draws.py).

A rank without samples steps on one zero row, sends zeros and keeps its non-trainable weights; its
seed generators advance as every rank's (rows.py).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from tarantella.backends import custom_logs, metric_sums
from tarantella.backends.rows import at_least_one_row, non_trainable_after_step
from tarantella.runtime.kinds import Collective


def train(step, model, state, data):
    """`model.train_step(state, data)` on the rank's micro-batch, global (`step`: the JaxStep)."""
    trainable, non_trainable, optimizer_state, metric_state = state
    return _run(step, model, "training", model.train_step, (trainable, non_trainable, optimizer_state),
                metric_state, data)


def test(step, model, state, data):
    """`model.test_step(state, data)` on the rank's micro-batch, global."""
    trainable, non_trainable, metric_state = state
    return _run(step, model, "test", model.test_step, (trainable, non_trainable), metric_state, data)


def _run(step, model, kind, step_function, leading_state, metric_state, data):
    """The user's `step_function` on the state (`leading_state` and the metric state zeroed); its
    state comes back in the same order, the metric state last."""
    data, samples = at_least_one_row(data)
    sequence = [f"a custom {kind} step"]
    global_samples = step._open_step(sequence, samples)
    share = (samples / global_samples).astype(jnp.float32)
    zeroed = [jnp.zeros_like(v) for v in metric_state]
    watched = custom_logs.WatchedMetrics(model.metrics, model.metrics_variables)
    with _global_step(step, model, watched, sequence, samples, global_samples, share):
        logs, new_state = step_function((*leading_state, zeroed), data)
    *new_leading, increments = new_state
    metric_state, logs = _global_metrics_and_logs(step, watched, sequence, metric_state, increments, logs,
                                                  share, samples > 0)
    new_leading[1] = non_trainable_after_step(model, samples, leading_state[1], new_leading[1])
    return logs, (*new_leading, metric_state)


@contextlib.contextmanager
def _global_step(step, model, watched, sequence, samples, global_samples, share):
    with contextlib.ExitStack() as stack:
        stack.enter_context(watched.installed())
        for optimizer in custom_logs.model_optimizers(model):
            stateless_apply, apply = _summed_updates(step, optimizer, sequence, share, samples > 0)
            stack.enter_context(custom_logs.instance_override(optimizer, "stateless_apply", stateless_apply))
            stack.enter_context(custom_logs.instance_override(optimizer, "apply", apply))
        stack.enter_context(step._global_loss_terms(sequence, samples, global_samples))
        stack.enter_context(step._serial_draws(samples, global_samples))
        stack.enter_context(step._refused_moments())
        yield


def _summed_updates(step, optimizer, sequence, share, contributes):
    """The optimizer's `stateless_apply` and `apply`, each summing the gradients over ranks once: a step
    may call either, `apply` inside a StatelessScope of its own; Keras' `stateless_apply` calls `apply`,
    which then passes its gradients on as they are. A LossScaleOptimizer's `stateless_apply` calls its
    inner optimizer's, which is not replaced."""
    original_stateless_apply, original_apply = optimizer.stateless_apply, optimizer.apply
    summing = []

    def summed(grads):
        weighted = [None if g is None else g * share.astype(g.dtype) for g in grads]
        present = [i for i, g in enumerate(weighted) if g is not None]
        totals = step._bucket_sum.fenced([weighted[i] for i in present], contributes, sequence=sequence)
        for i, total in zip(present, totals):
            weighted[i] = total
        return weighted

    def stateless_apply(optimizer_variables, grads, trainable_variables):
        summing.append(True)
        try:
            return original_stateless_apply(optimizer_variables, summed(grads), trainable_variables)
        finally:
            summing.pop()

    def apply(grads, trainable_variables=None):
        return original_apply(grads if summing else summed(grads), trainable_variables)

    return stateless_apply, apply


def _global_metrics_and_logs(step, watched, sequence, metric_state, increments, logs, share, contributes):
    """The metric state advanced by every rank's increments, and the logs read from it."""
    leaves, numbers = watched.split_logs(logs)
    values = list(increments) + list(numbers.values())
    if not values:
        return metric_state, logs
    weights = watched.weights(share) + [share] * len(numbers)
    flat = metric_sums.flat(values, step.widest_float, weights)
    if not contributes:
        flat = jnp.zeros_like(flat)
    what = Collective.LOSSES_AND_METRICS
    sequence.append(f"{what.what} of float32[{flat.size}]")
    summed = io_callback(functools.partial(step._sum_in_float64, what), jax.ShapeDtypeStruct(flat.shape, jnp.float32),
                         flat, ordered=True)
    summed_values = metric_sums.pieces(summed, values)
    metric_state = [before + piece for before, piece in zip(metric_state, summed_values[:len(increments)])]
    combined = dict(zip(numbers, summed_values[len(increments):]))

    def result_of(metric):
        return metric.stateless_result([metric_state[i] for i in watched.positions(metric)])

    return metric_state, watched.global_logs(logs, leaves, combined, result_of)
