"""A model's own `train_step(self, data)` and `test_step(self, data)` on Keras' PyTorch backend, made
global: keras-io's "Customizing what happens in fit() with PyTorch" (`zero_grad`, `loss.backward()`,
`optimizer.apply`) and the GANs, VAEs and distillers written like it.

Keras' torch trainer calls the step eagerly. `TorchStep` runs an overridden one on the rank's
micro-batch with every metric variable at zero, and while it runs:

1. the step opens with the sum of the ranks' sample counts m, the global batch size B;
2. every optimizer the model holds sums the gradients given to its `apply` (`apply_gradients` calls
   it) over the ranks before the update, each rank's weighted by its share m/B (the loss the user
   backpropagated is a mean over the micro-batch): one round of fused buckets per call, in the
   order the step makes them, which is the same on every rank;
3. compiled losses that do not divide by the micro-batch's entries are made global as in the
   built-in step (loss_terms.py);
4. afterwards the metric state holds the rank's increments: they are summed over ranks (a Mean fed
   one scalar per step weighted by the share) and added to the state before; the logs the step
   returned are read again from the global state, and any other number becomes its share-weighted
   sum (custom_logs.py);
5. keras.random's draws for the rank's rows (latent vectors, a VAE's epsilon, a GAN's noisy labels)
   are its rows of serial Keras' draws for the global batch (batch_draws.py).

The opening cannot know what the step will do (how many rounds, which logs), so every collective
after it carries its own agreement message: ranks whose steps differ fail with a clear error.
A rank without samples steps on one zero row, sends zeros and keeps its non-trainable weights; its
seed generators advance as every rank's (rows.py).
"""

import contextlib

import keras
import numpy as np
import torch

from tarantella.backends import custom_logs, loop_gradients, metric_sums
from tarantella.backends.rows import at_least_one_row, restore_without_samples
from tarantella.runtime.kinds import Collective


def run(step, kind, data):
    """The model's own `kind` ("train" or "test") step on the rank's micro-batch, global (`step`:
    the TorchStep); returns the global logs."""
    model = step._model
    data, samples = at_least_one_row(data)
    what = "a custom training step" if kind == "train" else "a custom test step"
    global_samples = step._comm.open_step(f"{Collective.STEP_OPENING.what} of {what}", what, samples)
    share = samples / global_samples
    kept = [v.numpy() for v in model.non_trainable_variables] if samples == 0 else None
    metric_variables = model.metrics_variables
    before = [np.array(v.numpy()) for v in metric_variables]
    for variable, value in zip(metric_variables, before):
        variable.assign(np.zeros_like(value))
    watched = custom_logs.WatchedMetrics(model.metrics, metric_variables)
    with contextlib.ExitStack() as stack:
        stack.enter_context(watched.installed())
        for optimizer in custom_logs.model_optimizers(model):
            stack.enter_context(custom_logs.instance_override(
                optimizer, "apply", _summed_apply(step, optimizer, share, samples > 0)))
        stack.enter_context(step._global_loss_terms(samples, global_samples))
        stack.enter_context(step._serial_draws(samples, global_samples))
        stack.enter_context(step._refused_moments())
        logs = model.train_step(data) if kind == "train" else model.test_step(data)
    if kept is not None:
        restore_without_samples(model, kept)
    return _global_logs(step, watched, metric_variables, before, logs, share, samples > 0)


def _summed_apply(step, optimizer, share, contributes):
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if present:
            arrays = [(grads[i].detach().cpu().numpy() * share) if contributes
                      else np.zeros(tuple(grads[i].shape), _numpy_dtype(grads[i])) for i in present]
            for i, total in zip(present, loop_gradients.sum_over_ranks(step._reducer, step._threshold_bytes, arrays)):
                grads[i] = torch.from_numpy(total).to(device=grads[i].device, dtype=grads[i].dtype)
        return original(grads, trainable_variables)

    return apply


def _global_logs(step, watched, metric_variables, before, logs, share, contributes):
    """Adds every rank's metric increments to the state before the step; the logs read from it."""
    leaves, numbers = watched.split_logs(logs)
    values = [v.numpy() for v in metric_variables] + [_to_numpy(n) for n in numbers.values()]
    if not values:
        return logs
    weights = watched.weights(share) + [share] * len(numbers)
    flat = metric_sums.flat(values, step.widest_float, weights, xp=metric_sums.NUMPY)
    if not contributes:
        flat = np.zeros_like(flat)
    summed = step._comm.allreduce_sum(flat, Collective.LOSSES_AND_METRICS)
    pieces = metric_sums.pieces(summed, values, xp=metric_sums.NUMPY)
    for variable, start, piece in zip(metric_variables, before, pieces):
        variable.assign(start + piece)
    combined = {index: torch.as_tensor(piece) for index, piece in zip(numbers, pieces[len(metric_variables):])}
    return watched.global_logs(logs, leaves, combined, lambda metric: metric.result())


def _to_numpy(value):
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _numpy_dtype(tensor):
    return np.dtype(keras.backend.standardize_dtype(tensor.dtype))
