"""The distributed step on Keras' PyTorch backend: each rank's micro-batch, combined into the serial step.

Keras' torch trainer runs `train_step` eagerly: forward, `loss.backward()`, then
`optimizer.apply`. `TorchStep` runs the wrapped model's own built-in step and makes three
things global:

1. the global batch size B: the step opens with the communicator's `open_step`, which
   agrees on the step's whole sequence of collectives and sums the ranks' sample counts m;
2. gradients: `optimizer.scale_loss` multiplies the loss by the rank's share m/B, so
   backprop yields share-weighted gradients. A hook on every trainable parameter
   (`register_post_accumulate_grad_hook`) copies each gradient into its bucket of the static
   plan (fusion.plan_buckets, last layer first) as soon as backprop has it, and hands a
   full bucket to the communicator at once, so the allreduce overlaps the rest of backprop.
   `optimizer.apply` waits for every bucket and applies the sums;
3. metrics: every metric variable starts the step at zero; the increments of all ranks are
   summed (one float64 allreduce) and added to the state the metric had. Keras feeds its
   loss tracker the micro-batch's loss weighted by m, so the sum holds the serial mean loss.

4. synchronized BatchNormalization (`layer.synchronized = True`, or
   `tnt.Model(..., synchronized_batch_normalization=True)`): during the training step Keras'
   torch `moments` (which refuses `synchronized=True`) is replaced. Each rank sums
   (count * mean, count * (variance + mean^2), count) of its micro-batch over ranks in float64,
   one allreduce per layer call in forward order; its backward (`_SumOverRanks`) is the
   allreduce of the incoming gradients, in backprop's order. The gradient buckets wait for the
   last of these (see `_GradientRound`).

A compiled loss that Keras does not divide by the micro-batch's number of entries (a mask from
`mask_zero` or `ignore_class`, `reduction="mean_with_sample_weight"` with weights) is made
global as on TensorFlow (loss_terms.global_loss_terms): the rank's divisor is summed over
ranks and the value rescaled so that the share-weighted sum is the serial loss;
`reduction="sum"` is multiplied by the inverse share B/m. Whether Keras divides by a mask is
known only once the forward pass has run, after the step's opening, so that allreduce opens
with its own agreement message.

Predictions are gathered inside the (eager) predict step: every rank returns all rows in
sample order. A rank without samples (a global batch smaller than the number of ranks) runs
the step on one zero row, contributes exact zeros and keeps its non-trainable weights; its seed
generators advance as every rank's (rows.py).
"""

import contextlib

import keras
import ml_dtypes
import numpy as np
import torch
# Keras' torch backend computes BatchNormalization's moments here, and refuses synchronized=True;
# tests/test_keras_internals.py checks that the layer still calls it.
from keras.src.backend.torch import nn as keras_torch_nn
# Keras' torch backend draws keras.random's numbers here (batch_draws.py replaces its shaped draws).
from keras.src.backend.torch import random as keras_torch_random

from tarantella.backends import (accumulation, batch_draws, custom_logs, fusion, loop_gradients, loss_terms,
                                 metric_sums, moments)
from tarantella.backends.base import Step
from tarantella.backends.rows import at_least_one_row, restore_without_samples
from tarantella.backends.tensorflow import devices as tensorflow_devices
from tarantella.backends.torch import custom_step
from tarantella.backends.torch import devices as torch_devices
from tarantella.runtime.kinds import Collective

_METRICS = Collective.LOSSES_AND_METRICS
_MOMENTS = Collective.BATCHNORM_MOMENTS
_MOMENTS_GRADIENTS = Collective.BATCHNORM_GRADIENTS


class TorchStep(Step):
    """Runs the wrapped model's built-in torch steps so that every rank gets the serial step's results."""

    backend_name = "PyTorch"
    custom_steps = True
    custom_training_loops = True
    keras_builds_from_an_extra_pass = True
    keras_steps_take_arrays = True

    @classmethod
    def collective_leaf(cls, name, leaf):
        if isinstance(leaf, (keras.Variable, torch.Tensor)):
            leaf = _host_array(leaf)  # its value as NumPy (and NumPy comes back, as on JAX)
        if not isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool, type(None))):
            raise TypeError(
                f"tnt.{name} does not take {type(leaf).__name__} values on Keras' PyTorch backend. Pass torch "
                "tensors, keras.Variables, NumPy arrays or numbers.")
        return leaf

    @classmethod
    def sum_loop_gradients(cls, grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks):
        arrays = [None if g is None else _host_array(g) for g in grads]
        samples = None if num_samples is None else _host_array(num_samples)
        summed = loop_gradients.summed_gradients(reducer, threshold_bytes, ranks, arrays, samples, loss_reduction)
        return [None if g is None else _tensor_like(total, g) for g, total in zip(grads, summed)]

    @classmethod
    def configure_devices(cls, share, threads):
        tensorflow_devices.configure(share, threads, computes_steps=False)  # the input pipeline's
        torch_devices.configure(share, threads)

    @classmethod
    def host_view(cls, variable):
        value = variable.value.detach()
        if value.dtype == torch.bfloat16:
            return variable.numpy()  # torch has no NumPy bfloat16; Keras converts
        return value.cpu().numpy()  # in place for a CPU tensor

    @classmethod
    def replayed_train_function(cls, model, train_function, replayer):
        # Keras-on-torch draws the step's batches before it calls the train function.
        def train_or_replay(batches):
            if replayer.over():
                model.train_function = train_function
                return train_function(batches)
            return replayer.replayed(model.steps_per_execution)
        return train_or_replay

    def __init__(self, communicator, reducer, model, threshold_bytes):
        self._comm = communicator
        self._reducer = reducer
        self._model = model
        self._threshold_bytes = threshold_bytes
        self._plan = None
        self._round = None  # the gradient round of the step that runs backprop now
        # A model's own train_step or test_step (custom_step.py), else Keras' built-in one.
        self._custom = {kind: getattr(type(model), f"{kind}_step") is not getattr(keras.Model, f"{kind}_step")
                        for kind in ("train", "test")}

    def expect_global_batch_size(self, size):
        """Not needed here: every step opens with the sum of the ranks' sample counts."""

    def optimizers(self):
        """Every optimizer the wrapped model holds (a custom step may apply several)."""
        return custom_logs.model_optimizers(self._model)

    def locally_accumulating_optimizers(self):
        """The built-in step's optimizer where it accumulates: a custom step sums every micro-step."""
        optimizer = getattr(self._model, "optimizer", None)
        return [optimizer] if not self._custom["train"] and accumulation.steps(optimizer) else []

    def expect_unknown_length(self, kind, global_batch_spec):
        """Not needed here: Keras-on-torch reads each batch before it runs a step."""

    def wrap_function(self, kind, function):
        """Keras' functions as they are: `predict` gathers inside the step."""
        return function

    # -- the steps, with Keras' torch trainer's signatures --------------------------------------

    def train(self, data):
        if self._custom["train"]:
            return custom_step.run(self, "train", data)
        model = self._model
        plan = self._gradient_plan()
        data, samples = at_least_one_row(data)
        metric_variables = model.metrics_variables
        optimizer = model.optimizer
        k = accumulation.steps(optimizer)
        summing = k is None or accumulation.is_update_step(int(optimizer._iterations.numpy()), k)
        sequence = "; ".join(["a training step", plan.description if summing else accumulation.NO_ROUND,
                              _metrics_description(metric_variables)])
        global_samples = self._comm.open_step(f"{Collective.STEP_OPENING.what} of a training step",
                                              sequence, samples)
        share = samples / global_samples
        kept = [v.numpy() for v in model.non_trainable_variables] if samples == 0 else None
        state_before = _zero(metric_variables)
        if summing:
            accumulated = None if k is None else _taken_accumulators(optimizer, plan.variables)
            self._round = _GradientRound(self._reducer, plan, contributes=samples > 0, accumulated=accumulated)
            applying = _applying_summed_gradients(optimizer, self._round)
        else:  # an accumulation micro-step: the rank's own gradients (accumulation.py)
            applying = _own_gradients(optimizer, contributes=samples > 0)
        try:
            with _share_weighted_scale_loss(optimizer, share), applying, \
                    self._global_loss_terms(samples, global_samples), \
                    _global_moments(self._comm, self._round, contributes=samples > 0):
                model.train_step(data)
        finally:
            self._round = None
        if kept is not None:
            restore_without_samples(model, kept)
        return self._global_metrics(metric_variables, state_before, samples > 0)

    def test(self, data):
        if self._custom["test"]:
            return custom_step.run(self, "test", data)
        model = self._model
        data, samples = at_least_one_row(data)
        metric_variables = model.metrics_variables
        sequence = "; ".join(["a test step", _metrics_description(metric_variables)])
        global_samples = self._comm.open_step(f"{Collective.STEP_OPENING.what} of a test step", sequence,
                                              samples)
        state_before = _zero(metric_variables)
        with self._global_loss_terms(samples, global_samples):
            model.test_step(data)
        return self._global_metrics(metric_variables, state_before, samples > 0)

    def _global_loss_terms(self, samples, global_samples):
        """While the step runs: the compiled loss terms that do not divide by the micro-batch's
        entries (masked, weighted mean, summed) are made global, their divisors summed over ranks
        in a collective of their own (whether one is needed shows only as the loss is computed,
        after the opening)."""
        compile_loss = getattr(self._model, "_compile_loss", None)
        if compile_loss is None or not compile_loss.built:
            return contextlib.nullcontext()

        def sum_over_ranks(local):
            vector = np.array([float(local)], np.float64)
            return float(self._comm.allreduce_sum(vector, Collective.LOSS_DIVISOR)[0])

        inverse_share = global_samples / samples if samples else 0.0
        return loss_terms.global_loss_terms(compile_loss, lambda: inverse_share, sum_over_ranks)

    def _refused_moments(self):
        """While a custom step runs: synchronized BatchNormalization refused, on every rank."""
        return custom_logs.refused_synchronized_moments(keras_torch_nn, self.backend_name)

    def _serial_draws(self, samples, global_samples):
        """While a custom step runs: draws for the rank's rows are serial Keras' draws for the global
        batch, of which the rank draws all B rows per block (batch_draws.py)."""
        return batch_draws.serial_draws(keras_torch_random, samples, self._comm.rank, self._comm.size,
                                        global_samples, global_samples)

    def predict(self, data):
        """Every rank's predictions of the global batch, in sample order."""
        data, samples = at_least_one_row(data)
        outputs = self._model.predict_step(data)
        leaves = keras.tree.flatten(outputs)
        own_rows = [_host_array(leaf[:samples]) for leaf in leaves]
        every_rank = self._comm.allgather_interleaved_rows(own_rows, Collective.PREDICTIONS)
        return keras.tree.pack_sequence_as(outputs, [_tensor_like(rows, leaf) for rows, leaf in zip(every_rank, leaves)])

    # -- gradients ------------------------------------------------------------------------------

    def _gradient_plan(self):
        """The bucket plan of the current trainable variables, with a hook on each parameter;
        made again when the trainable variables change (e.g. a layer frozen between fits)."""
        variables = list(self._model.trainable_variables)
        if self._plan is None or self._plan.variables != variables:
            if self._plan is not None:
                self._plan.remove_hooks()
            self._plan = _BucketPlan(variables, self._threshold_bytes, self._reducer.reduction.wire,
                                     self._on_gradient_ready)
        return self._plan

    def _on_gradient_ready(self, position, parameter):
        # Outside a distributed step (a user's own backward) there is no round to feed.
        if self._round is not None:
            self._round.add(position, parameter.grad)

    # -- metrics --------------------------------------------------------------------------------

    def _global_metrics(self, metric_variables, state_before, contributes):
        """Adds every rank's metric increments to the state before the step; returns Keras' logs."""
        if metric_variables:
            increments = metric_sums.flat([v.numpy() for v in metric_variables], self.widest_float,
                                          xp=metric_sums.NUMPY)
            if not contributes:
                increments = np.zeros_like(increments)
            summed = self._comm.allreduce_sum(increments, _METRICS, agreed=True)
            pieces = metric_sums.pieces(summed, state_before, xp=metric_sums.NUMPY)
            for variable, before, piece in zip(metric_variables, state_before, pieces):
                variable.assign(before + piece)
        return self._model.get_metrics_result()


@contextlib.contextmanager
def _global_moments(communicator, gradient_round, contributes):
    """During the training step: synchronized BatchNormalization normalizes with the moments of
    the global batch (Keras' own torch `moments` for every other call)."""
    original = keras_torch_nn.moments

    def moments(x, axes, keepdims=False, synchronized=False):
        if not synchronized:
            return original(x, axes, keepdims=keepdims)
        return _moments_of_every_rank(communicator, gradient_round, contributes, x, axes, keepdims)

    keras_torch_nn.moments = moments
    try:
        yield
    finally:
        keras_torch_nn.moments = original


def _moments_of_every_rank(communicator, gradient_round, contributes, x, axes, keepdims):
    """The mean and variance of the global batch (backends/moments.py), summed in float64."""
    x = keras_torch_nn.convert_to_tensor(x)
    local, shape, axes = moments.local_sums(x, axes, TorchStep.widest_float, contributes)
    if gradient_round is not None and local.requires_grad and torch.is_grad_enabled():  # autograd will run its backward
        gradient_round.expect_moments_gradients()
    summed = _SumOverRanks.apply(local, communicator, gradient_round, contributes)
    return moments.global_moments(summed, shape, axes, keepdims, x.dtype)


class _SumOverRanks(torch.autograd.Function):
    """The sum over ranks of a float64 vector; its gradient is the sum over ranks of the incoming
    gradients.

    Each rank backpropagates its loss times its share m/B, so the gradient reaching rank q's sum is
    share_q * dL_q/dS already; the serial loss is sum_q share_q * L_q, and its derivative with
    respect to rank r's own moments is the plain sum of those gradients over ranks. A rank without
    samples sends zeros (its one zero row's gradients may hold NaN).

    Each collective opens with its own agreement message (the step's opening cannot know how many
    layer calls the forward pass makes), so ranks that differ fail with a clear error. Backward
    allreduces run inside loss.backward(), while the gradient hooks hand buckets over: see
    `_GradientRound` for why the two cannot interleave."""

    @staticmethod
    def forward(ctx, vector, communicator, gradient_round, contributes):
        ctx.communicator, ctx.gradient_round, ctx.contributes = communicator, gradient_round, contributes
        summed = communicator.allreduce_sum(vector.detach().cpu().numpy(), _MOMENTS)
        return torch.from_numpy(summed).to(vector.device)

    @staticmethod
    def backward(ctx, upstream):
        device = upstream.device
        upstream = upstream.detach().cpu().numpy().astype(np.float64)
        if not ctx.contributes:
            upstream = np.zeros_like(upstream)
        summed = torch.from_numpy(ctx.communicator.allreduce_sum(upstream, _MOMENTS_GRADIENTS)).to(device)
        if ctx.gradient_round is not None:
            ctx.gradient_round.moments_gradients_done()
        return summed, None, None, None


class _BucketPlan:
    """Where each trainable variable's gradient goes: its bucket, and its place in the bucket."""

    def __init__(self, variables, threshold_bytes, wire, on_ready):
        self.variables = variables
        layout = fusion.BucketLayout([int(np.prod(v.shape)) for v in variables],
                                     [fusion.wire_dtype(keras.backend.standardize_dtype(v.dtype)) for v in variables],
                                     threshold_bytes, list(reversed(range(len(variables)))))
        self.buckets = layout.buckets  # (dtype name, size, [(variable index, offset, size)])
        self.place = layout.place  # variable index -> (bucket, offset, size)
        self.description = fusion.round_description(layout.names(), wire)
        self._hooks = [v.value.register_post_accumulate_grad_hook(
            lambda parameter, position=i: on_ready(position, parameter)) for i, v in enumerate(variables)]

    def remove_hooks(self):
        for hook in self._hooks:
            hook.remove()


class _GradientRound:
    """One step's buckets: filled by the hooks as backprop goes, each handed to the communicator
    when its last gradient arrives, or, while synchronized BatchNormalization still has backward
    allreduces to come, as soon as the last of those has run.

    Why they wait: the communicator reduces a step's buckets in one job on its worker thread,
    which starts with the first bucket handed over and ends only when every bucket is reduced. A
    synchronous collective submitted after it (a BatchNormalization layer's backward allreduce)
    would wait for that job, and the job for gradients that backprop computes only after that
    allreduce: a deadlock. And which bucket is complete when a given layer's backward runs
    depends on autograd's schedule, which should not decide the order of collectives. So every
    forward allreduce of moments that autograd will differentiate counts one backward allreduce
    to come; buckets completed while any is to come are held, and handed over, in plan order,
    right after the last one has returned (or when the optimizer asks for the sums, if some never
    ran: a layer whose output the loss does not use). Every rank thus issues the same sequence:
    the forward allreduces in layer order, the backward ones in backprop's order (the same graph,
    the same order on every rank; each carries its own agreement message, so ranks that differ
    fail with a clear error rather than mix data), then the gradient round. The buckets then
    overlap only the backprop that follows the last backward allreduce (the layers before the
    first synchronized BatchNormalization)."""

    def __init__(self, reducer, plan, contributes, accumulated=None):
        """`accumulated` (an update step of an accumulating optimizer): {variable index: what
        the rank accumulated, in the gradients' scale}, which the buckets start from and the
        gradients are added to."""
        self._reducer = reducer
        self.plan = plan
        self._contributes = contributes
        # Zeros: a rank without samples sends them as they are, and a variable without a
        # gradient (not reached by the loss) adds nothing.
        self._buffers = [np.zeros(size, dtype) for dtype, size, _ in plan.buckets]
        self._adds = accumulated is not None
        for i, value in (accumulated or {}).items():
            bucket, offset, size = plan.place[i]
            self._buffers[bucket][offset:offset + size] = value.reshape(-1)
        self._missing = [len(members) for _, _, members in plan.buckets]
        self._handed_over = [False] * len(plan.buckets)
        self._moments_gradients_to_come = 0
        self._held = []  # complete buckets waiting for the last backward allreduce of moments

    def expect_moments_gradients(self):
        self._moments_gradients_to_come += 1

    def moments_gradients_done(self):
        self._moments_gradients_to_come -= 1
        if self._moments_gradients_to_come == 0:
            self._release_held()

    def _release_held(self):
        held, self._held = sorted(self._held), []
        for bucket in held:
            self._hand_over(bucket)

    def add(self, position, gradient):
        bucket, offset, size = self.plan.place[position]
        if self._contributes:
            flat = gradient.detach().reshape(-1)
            if flat.dtype == torch.bfloat16:  # NumPy has no bfloat16; its bucket is float32 (exact)
                flat = flat.float()
            if self._adds:
                self._buffers[bucket][offset:offset + size] += flat.cpu().numpy()
            else:
                self._buffers[bucket][offset:offset + size] = flat.cpu().numpy()
        self._missing[bucket] -= 1
        if self._missing[bucket] == 0:
            if self._moments_gradients_to_come > 0:
                self._held.append(bucket)
            else:
                self._hand_over(bucket)

    def _hand_over(self, bucket):
        self._handed_over[bucket] = True
        self._reducer.submit(bucket, len(self._buffers), self._buffers[bucket], agreed=True)

    def summed_gradients(self):
        """{variable index: the gradient summed over ranks}, once every bucket is reduced."""
        if not self._buffers:
            return {}
        self._moments_gradients_to_come = 0
        self._release_held()
        for bucket, handed_over in enumerate(self._handed_over):
            if not handed_over:  # some of its variables got no gradient in this backprop
                self._hand_over(bucket)
        summed = {}
        for (_, _, members), flat in zip(self.plan.buckets, self._reducer.collect()):
            for i, offset, size in members:
                variable = self.plan.variables[i]
                summed[i] = torch.from_numpy(flat[offset:offset + size]).reshape(tuple(variable.shape)).to(
                    device=variable.value.device, dtype=variable.value.dtype)
        return summed


@contextlib.contextmanager
def _share_weighted_scale_loss(optimizer, share):
    """Keras' train_step differentiates `optimizer.scale_loss(loss)`: weighting that scalar by the
    rank's share weights every gradient, with no pass over them."""
    original = optimizer.scale_loss
    optimizer.scale_loss = lambda loss: original(loss) * share
    try:
        yield
    finally:
        del optimizer.scale_loss


@contextlib.contextmanager
def _applying_summed_gradients(optimizer, gradient_round):
    """`optimizer.apply` waits for the step's buckets and applies the sums over ranks."""
    original = optimizer.apply
    position = {id(v): i for i, v in enumerate(gradient_round.plan.variables)}

    def apply(grads, trainable_variables=None):
        summed = gradient_round.summed_gradients()
        variables = gradient_round.plan.variables if trainable_variables is None else trainable_variables
        return original([summed.get(position.get(id(v)), g) for v, g in zip(variables, grads)], variables)

    optimizer.apply = apply
    try:
        yield
    finally:
        del optimizer.apply


@contextlib.contextmanager
def _own_gradients(optimizer, contributes):
    """A micro-step that only accumulates: `optimizer.apply` gets the rank's own share-weighted
    gradients, unsummed (zeros on a rank without samples, whose zero row's gradients may hold
    NaN), and adds them to the rank's accumulators (accumulation.py)."""
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        if not contributes:
            grads = [None if g is None else torch.zeros_like(g) for g in grads]
        return original(grads, trainable_variables)

    optimizer.apply = apply
    try:
        yield
    finally:
        del optimizer.apply


def _taken_accumulators(optimizer, variables):
    """{variable index: the rank's accumulator in the gradients' scale, as NumPy}, for the update
    step's round to send; the accumulators are zeroed, so that the optimizer applies the sum over
    ranks alone."""
    taken = {}
    for i, accumulator in enumerate(accumulation.accumulators(optimizer, variables)):
        value = accumulator.value.detach()
        wire = value.float() if value.dtype in (torch.float16, torch.bfloat16) else value  # NumPy has no bfloat16
        # A copy: Keras' torch variable is zeroed in place, and NumPy would see its memory.
        taken[i] = np.array(accumulation.in_gradient_scale(wire, optimizer).cpu().numpy())
        accumulator.assign(torch.zeros_like(value))
    return taken


def _metrics_description(metric_variables):
    return f"{_METRICS.what} of float64[{sum(int(np.prod(v.shape)) for v in metric_variables)}]"


def _host_array(value):
    """A NumPy copy of a torch tensor, a Keras variable or a number; bfloat16 as ml_dtypes' bfloat16,
    which torch's `numpy()` refuses."""
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def _tensor_like(array, like):
    """NumPy `array` as a torch tensor on the device and of the dtype of `like` (where it is a tensor);
    an ml_dtypes bfloat16 array, which `torch.from_numpy` refuses, through float32 (exact)."""
    if array.dtype == ml_dtypes.bfloat16:
        array = array.astype(np.float32)
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if isinstance(like, torch.Tensor):
        return tensor.to(device=like.device, dtype=like.dtype)
    return tensor


def _zero(variables):
    """Sets `variables` to zero; returns their values before."""
    before = [np.array(v.numpy()) for v in variables]
    for variable, value in zip(variables, before):
        variable.assign(np.zeros_like(value))
    return before
