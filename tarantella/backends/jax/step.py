"""The distributed step on Keras' JAX backend: each rank's micro-batch, combined into the serial step.

Keras' JAX trainer jits a pure `train_step(state, data)`. `JaxStep` builds that function
from the wrapped model's stateless parts (`compute_loss_and_updates`, the optimizer's
`stateless_apply`, the metrics' stateless updates), with four things made global:

1. the global batch size B: the step opens with the communicator's `open_step`, which
   agrees on the step's whole sequence of collectives and sums the ranks' sample counts m
   (a static number in a jitted step, as every shape is);
2. gradients: each rank differentiates its loss times its share m/B, and the gradients are
   summed over ranks in fused buckets (the plan of backends/fusion.py, last layer first). A gradient
   that alone reaches the fusion threshold is its own bucket, handed over unconcatenated. The
   sum is a `buffer_callback` whose outputs alias its inputs: the worker sums each bucket in
   place, in the very buffer XLA computed it in, so nothing is copied in or out and no fresh
   output buffer is allocated; across nodes each bucket is handed over by its own callback as
   XLA computes it (gradient_sums.py says why that is safe). On a GPU the buckets are an ordered
   `io_callback`'s instead: JAX copies them to the host and their sums back;
3. metrics: every metric variable starts the step at zero; the increments of all ranks are
   summed and added to the state the metric had. Keras feeds its loss tracker the
   micro-batch's loss weighted by m, so the summed tracker holds the serial mean loss.
4. losses that do not divide by the micro-batch's entries (masked, weighted means, sums):
   each compiled loss term's divisor is summed over ranks and its value rescaled
   (loss_terms.global_loss_terms), so that share-weighted sums give the serial loss;
5. synchronized BatchNormalization (`layer.synchronized = True`, or
   `tnt.Model(..., synchronized_batch_normalization=True)`): while the training step is traced,
   Keras' JAX `moments` (which refuses `synchronized=True`) is replaced. Each rank sums
   (count * mean, count * (variance + mean^2), count) of its micro-batch over ranks, one
   allreduce per layer call in forward order, under a `jax.custom_vjp` whose backward pass is
   the allreduce of the incoming cotangents, in backward order (see `_global_moments`).

The opening, the divisors, the moments and the metric sum each run inside the jitted step as an
ordered `io_callback` that hands its job to the communicator's worker thread and waits for it:
ordered callbacks run in program order. The gradient sum is in no such chain (a
`buffer_callback` has no ordered effect), so its inputs and outputs place it: it takes every
gradient (a rank sending zeros passes them too, unread), which come after the opening and the
loss's and backprop's callbacks, and the metric sum takes a piece of its result; per bucket,
each hand-over also takes an ordered fence, after every ordered callback traced before it. The
worker issues every collective of the process in one fixed order, so every rank issues the same
collectives in the same order.

On one node the gradient sum runs after the whole backprop: handing each bucket over as XLA
computes it measured no faster on 2 ranks sharing 2 cores, where backprop and the allreduce
compete for the same cores; across nodes, where the link is slower than the cores, it overlaps
backprop and won (docs/performance.md, "JAX: buckets as XLA computes them"). Two earlier forms
of the single sum cost more than the ring allreduce itself, for the MLP of
benchmarks/scaling.py (40 MB of gradients): an `io_callback`, which JAX copies its arguments
into with a `device_put` (on a rank bound to a single core that copy waited for XLA's only
thread, the one blocked in the callback: the job hung, tests/test_jax_backend.py runs such a
job) and its results out of; then a `buffer_callback` writing into fresh output buffers, whose
pages the kernel zeroes and faults in anew each step.

Predictions are gathered outside the jitted step (`wrap_function`): the size of the
global batch is not known to the trace, and a gather needs it for its result's shape.

A rank without samples (a global batch smaller than the number of ranks) runs the step on one
zero row and contributes exact zeros; it keeps its non-trainable weights as they were, and its seed
generators advance as every rank's (rows.py).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback
# Keras' JAX backend computes BatchNormalization's moments here, and refuses synchronized=True;
# tests/test_keras_internals.py checks that the layer still calls it.
from keras.src.backend.jax import nn as keras_jax_nn
# Keras' JAX backend draws keras.random's numbers here (batch_draws.py replaces its shaped draws).
from keras.src.backend.jax import random as keras_jax_random

from tarantella.backends import (accumulation, batch_draws, custom_logs, loop_gradients, loss_terms, metric_sums,
                                 moments)
from tarantella.backends.base import Step
from tarantella.backends.rows import at_least_one_row, non_trainable_after_step
from tarantella.backends.jax import custom_step
from tarantella.backends.jax import devices as jax_devices
from tarantella.backends.jax import gradient_sums
from tarantella.backends.jax.gradient_sums import BucketSum
from tarantella.backends.tensorflow import devices as tensorflow_devices
from tarantella.runtime.kinds import Collective

_MOMENTS = Collective.BATCHNORM_MOMENTS
_MOMENTS_GRADIENTS = Collective.BATCHNORM_GRADIENTS


class JaxStep(Step):
    """Builds the pure train, test and predict steps that Keras' JAX trainer jits."""

    backend_name = "JAX"
    custom_steps = True
    custom_training_loops = True
    keras_builds_from_an_extra_pass = True
    keras_steps_take_arrays = True
    # JAX has no float64 unless x64 is switched on for the whole process; the sums over the ranks
    # are still added in float64, on the host.
    widest_float = "float32"

    @classmethod
    def check_platform(cls):
        refusal = platform_refusal(jax.default_backend())
        if refusal:
            raise NotImplementedError(refusal)

    @classmethod
    def collective_leaf(cls, name, leaf):
        if isinstance(leaf, keras.Variable):
            # Its value, as for a JAX array; inside jitted code a variable's value is traced, and refused.
            leaf = leaf.value
        if type(leaf).__module__.startswith("jax"):
            if isinstance(leaf, jax.core.Tracer):
                raise NotImplementedError(
                    f"tnt.{name} cannot run inside jitted code (a custom step, a jax.jit function) on Keras' JAX "
                    "backend yet. Call it outside jit, on NumPy or JAX arrays (e.g. in a callback or between fit "
                    "calls); inside jit, sum gradients with tnt.optimizers.allreduce_gradients or "
                    "tnt.optimizers.Optimizer; or use the TensorFlow backend, where it runs inside tf.function.")
            leaf = np.asarray(leaf)
        return leaf

    @classmethod
    def sum_loop_gradients(cls, grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks):
        leaves = [g for g in grads if g is not None] + ([] if num_samples is None else [num_samples])
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # inside jax.jit: a fenced callback
            return gradient_sums.loop_sum(reducer, threshold_bytes, ranks, list(grads), num_samples, loss_reduction)
        arrays = [None if g is None else np.asarray(g) for g in grads]
        summed = loop_gradients.summed_gradients(reducer, threshold_bytes, ranks, arrays,
                                                 None if num_samples is None else np.asarray(num_samples),
                                                 loss_reduction)
        return [None if total is None else jnp.asarray(total) for total in summed]

    @classmethod
    def configure_devices(cls, share, threads):
        tensorflow_devices.configure(share, threads, computes_steps=False)  # the input pipeline's
        jax_devices.configure(share)

    @classmethod
    def host_view(cls, variable):
        return np.asarray(variable.value)  # in place for a CPU array (Keras' numpy() copies)

    @classmethod
    def replayed_train_function(cls, model, train_function, replayer):
        # A pure function of the state and the iterator.
        def train_or_replay(state, iterator):
            if replayer.over():
                model.train_function = train_function
                return train_function(state, iterator)
            for _ in range(model.steps_per_execution):
                next(iterator)
            return replayer.replayed(model.steps_per_execution), state
        return train_or_replay

    def __init__(self, communicator, reducer, model, threshold_bytes):
        self._comm = communicator
        self._reducer = reducer
        self._model = model
        self._threshold_bytes = threshold_bytes
        self._bucket_sum = BucketSum(reducer, threshold_bytes, gradient_sums.hands_over_per_bucket())
        # A model's own stateless train_step or test_step (custom_step.py), else Keras' built-in one.
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

    # -- the steps, with Keras' JAX trainer's signatures --------------------------------------

    def train(self, state, data):
        if self._custom["train"]:
            return custom_step.train(self, self._model, state, data)
        trainable, non_trainable, optimizer_state, metric_state = state
        model = self._model
        optimizer = model.optimizer
        data, samples = at_least_one_row(data)
        sequence = ["a training step"]
        accumulating = _Accumulation.of(optimizer, optimizer_state)
        global_samples = self._open_step(sequence, samples, None if accumulating is None else accumulating.summing)
        share = (samples / global_samples).astype(jnp.float32)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        zeroed = [jnp.zeros_like(v) for v in metric_state]

        def share_of_loss(trainable):
            with self._global_loss_terms(sequence, samples, global_samples), \
                    self._global_moments(sequence, contributes=samples > 0):
                loss, aux = model.compute_loss_and_updates(
                    trainable, non_trainable, zeroed, x, y, sample_weight, training=True,
                    optimizer_variables=optimizer_state)
            return loss * share.astype(loss.dtype), aux

        (_, aux), grads = jax.value_and_grad(share_of_loss, has_aux=True)(trainable)
        unscaled_loss, y_pred, new_non_trainable, increments = aux
        if accumulating is None:
            grads, summed = self._sum_gradients(sequence, grads, contributes=samples > 0)
        else:
            grads, summed, optimizer_state = accumulating.gradients(self._bucket_sum, sequence, grads,
                                                                    contributes=samples > 0)
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        _, increments = model._update_metrics_variables(increments, unscaled_loss, x, y, y_pred, sample_weight)
        metric_state = self._add_global_increments(sequence, metric_state, increments, samples > 0, after=summed)
        non_trainable = non_trainable_after_step(model, samples, non_trainable, new_non_trainable)
        return self._logs(metric_state), (trainable, non_trainable, optimizer_state, metric_state)

    def test(self, state, data):
        if self._custom["test"]:
            return custom_step.test(self, self._model, state, data)
        trainable, non_trainable, metric_state = state
        model = self._model
        data, samples = at_least_one_row(data)
        sequence = ["a test step"]
        global_samples = self._open_step(sequence, samples)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        zeroed = [jnp.zeros_like(v) for v in metric_state]
        with self._global_loss_terms(sequence, samples, global_samples):
            _, (unscaled_loss, y_pred, new_non_trainable, increments) = model.compute_loss_and_updates(
                trainable, non_trainable, zeroed, x, y, sample_weight, training=False)
        _, increments = model._update_metrics_variables(increments, unscaled_loss, x, y, y_pred, sample_weight)
        metric_state = self._add_global_increments(sequence, metric_state, increments, samples > 0)
        non_trainable = non_trainable_after_step(model, samples, non_trainable, new_non_trainable)
        return self._logs(metric_state), (trainable, non_trainable, metric_state)

    def predict(self, state, data):
        """The rank's own predictions; `wrap_function` gathers them."""
        data, samples = at_least_one_row(data)
        outputs, non_trainable = self._model.predict_step(state, data)
        return jax.tree.map(lambda t: t[:samples], outputs), non_trainable

    def expect_unknown_length(self, kind, global_batch_spec):
        """Not needed here: Keras-on-JAX reads each batch before it runs a step."""

    def wrap_function(self, kind, function):
        """Keras' `kind` of function as it runs here: the predict function returns every rank's
        predictions in sample order."""
        if kind != "predict":
            return function
        if self._model.steps_per_execution > 1:
            raise NotImplementedError(
                "predict with steps_per_execution > 1 is not supported on Keras' JAX backend with several "
                "ranks yet (its batches would come back out of order). Compile with steps_per_execution=1 "
                "for predict, or use the TensorFlow backend.")

        def gathered(state, iterator):
            outputs, state = function(state, iterator)
            leaves, structure = jax.tree.flatten(outputs)
            every_rank = self._comm.allgather_interleaved_rows([np.asarray(leaf) for leaf in leaves],
                                                               Collective.PREDICTIONS)
            return jax.tree.unflatten(structure, every_rank), state

        return gathered

    # -- the collectives, as ordered callbacks ------------------------------------------------

    def _open_step(self, sequence, samples, summing=None):
        """B, the sum of the ranks' `samples`; the opening agrees on `sequence`, which the
        rest of the trace completes before the step first runs. `summing` (a traced bool, where
        the optimizer accumulates): whether the step's gradient round takes place."""
        what = f"{Collective.STEP_OPENING.what} of {sequence[0]}"

        def open_step(*summing):
            described = accumulation.described(sequence, [bool(flag) for flag in summing])
            return np.int32(self._comm.open_step(what, "; ".join(described), samples))

        return io_callback(open_step, jax.ShapeDtypeStruct((), jnp.int32), *(() if summing is None else (summing,)),
                           ordered=True)

    def _global_loss_terms(self, sequence, samples, global_samples):
        """While the loss is traced: the compiled loss terms that do not divide by the micro-batch's
        entries (masked, weighted mean, summed) are made global, their divisors summed over ranks."""
        compile_loss = getattr(self._model, "_compile_loss", None)
        if compile_loss is None or not compile_loss.built:
            return contextlib.nullcontext()
        inverse_share = (global_samples / samples).astype(jnp.float32) if samples else jnp.float32(0)
        what = Collective.LOSS_DIVISOR

        def sum_over_ranks(local):
            sequence.append(f"{what.what} of float32[1]")
            local = jnp.reshape(jax.lax.stop_gradient(local).astype(jnp.float32), (1,))
            summed = io_callback(functools.partial(self._sum_in_float64, what),
                                 jax.ShapeDtypeStruct((1,), jnp.float32), local, ordered=True)
            return summed[0]

        return loss_terms.global_loss_terms(compile_loss, lambda: inverse_share, sum_over_ranks)

    @contextlib.contextmanager
    def _global_moments(self, sequence, contributes):
        """While the loss is traced: synchronized BatchNormalization normalizes with the moments
        of the global batch.

        The sum over ranks is linear, so its derivative is the sum over ranks of the incoming
        cotangents. Each rank differentiates its loss times its share m/B, so the cotangent that
        reaches rank q's summed moments is already weighted: share_q * dL_q/dS. The serial loss
        is sum_q share_q * L_q, whose derivative with respect to rank r's own moments is
        sum_q share_q * dL_q/dS: the plain sum of the ranks' cotangents, with no weight put in
        or taken out (TensorFlow's loss_weighted branch). A rank without samples sends zeros
        both ways (its zero row's cotangents may hold NaN). Forward allreduces come in the
        order the layers are called, backward ones in backprop's order (JAX traces the custom
        rules' backward passes in reverse), all before the gradient buckets: they are ordered
        callbacks, and the buckets depend on the gradients they produce."""
        original = keras_jax_nn.moments

        def moments(x, axes, keepdims=False, synchronized=False):
            if not synchronized:
                return original(x, axes, keepdims=keepdims)
            return self._moments_of_every_rank(sequence, contributes, x, axes, keepdims)

        keras_jax_nn.moments = moments
        try:
            yield
        finally:
            keras_jax_nn.moments = original

    def _serial_draws(self, samples, global_samples):
        """While a custom step is traced: draws for the rank's rows are serial Keras' draws for the
        global batch (batch_draws.py). B is traced; JAX's threefry numbers depend on their position
        alone, so the rank draws r + p*m rows per block, as many as B can have, and keeps its own."""
        rank, size = self._comm.rank, self._comm.size
        return batch_draws.serial_draws(keras_jax_random, samples, rank, size, global_samples, rank + size * samples)

    def _refused_moments(self):
        """While a custom step runs: synchronized BatchNormalization refused, on every rank."""
        return custom_logs.refused_synchronized_moments(keras_jax_nn, self.backend_name)

    def _moments_of_every_rank(self, sequence, contributes, x, axes, keepdims):
        local, shape, axes = moments.local_sums(x, axes, self.widest_float, contributes)
        summed = self._summed_with_summed_gradients(sequence, contributes, local)
        return moments.global_moments(summed, shape, axes, keepdims, x.dtype)

    def _summed_with_summed_gradients(self, sequence, contributes, local):
        """The sum over ranks of `local`, whose cotangent is the sum over ranks of the cotangents."""
        spec = jax.ShapeDtypeStruct(local.shape, local.dtype)
        forward = functools.partial(self._sum_in_float64, _MOMENTS)
        backward = functools.partial(self._sum_in_float64, _MOMENTS_GRADIENTS)

        @jax.custom_vjp
        def sum_over_ranks(vector):
            return io_callback(forward, spec, vector, ordered=True)

        def sum_forward(vector):
            return sum_over_ranks(vector), None

        def sum_backward(_, cotangent):
            if not contributes:
                cotangent = jnp.zeros_like(cotangent)
            sequence.append(f"{_MOMENTS_GRADIENTS.what} of float64[{cotangent.size}]")
            return (io_callback(backward, spec, cotangent, ordered=True),)

        sum_over_ranks.defvjp(sum_forward, sum_backward)
        sequence.append(f"{_MOMENTS.what} of float64[{local.size}]")
        return sum_over_ranks(local)

    def _sum_gradients(self, sequence, grads, contributes, after=()):
        """The sum over ranks of the (share-weighted) `grads`, and one summed bucket that later
        collectives of the step take as an input, so that they run after this one; a rank that
        does not contribute sends zeros (its zero row's gradients may hold NaN). `after`: arrays
        the sum receives unread, to run after what computes them."""
        return self._bucket_sum(grads, contributes, sequence=sequence, after=after)

    def _add_global_increments(self, sequence, metric_state, increments, contributes, after=None):
        """The metric state advanced by the increments of every rank. `after` (optional, an
        array the callback receives unread) keeps the allreduce after the computation of it: the
        gradient sum's callback is in no ordered chain of callbacks."""
        if not increments:
            return metric_state
        flat = metric_sums.flat(increments, self.widest_float)
        if not contributes:
            flat = jnp.zeros_like(flat)
        what = Collective.LOSSES_AND_METRICS
        sequence.append(f"{what.what} of float32[{flat.size}]")
        summed = io_callback(functools.partial(self._sum_in_float64, what), jax.ShapeDtypeStruct(flat.shape,
                             jnp.float32), flat, *(() if after is None else (after,)), ordered=True)
        return [before + piece for before, piece in zip(metric_state, metric_sums.pieces(summed, metric_state))]

    def _sum_in_float64(self, what, vector, *unread):
        # JAX computes in float32 unless x64 is on; the ranks' increments are added in float64.
        dtype = np.asarray(vector).dtype
        return self._comm.allreduce_sum(np.asarray(vector, np.float64), what, agreed=True).astype(
            dtype if dtype in (np.float32, np.float64) else np.float32)

    def _logs(self, metric_state):
        """Keras' logs, read from the combined metric state."""
        model = self._model
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metric_state))):
            return model.get_metrics_result()


class _Accumulation:
    """The built-in step's gradients where its optimizer accumulates them (accumulation.py): one
    round of sums over the ranks per update step, none on the micro-steps between."""

    @classmethod
    def of(cls, optimizer, optimizer_state):
        """The step's accumulation, or None where every micro-step sums its gradients."""
        k = accumulation.steps(optimizer)
        return None if k is None else cls(optimizer, optimizer_state, k)

    def __init__(self, optimizer, optimizer_state, k):
        self._optimizer = optimizer
        self._state = list(optimizer_state)
        position = {id(v): i for i, v in enumerate(optimizer.variables)}
        self._places = [position[id(a)] for a in accumulation.accumulators(optimizer, optimizer._trainable_variables)]
        # The optimizer's own decision, from the iterations it gets (as stateless_apply takes them).
        self.summing = accumulation.is_update_step(self._state[position[id(optimizer._iterations)]], k)

    def gradients(self, bucket_sum, sequence, grads, contributes):
        """(what the optimizer applies, one summed element for later collectives to take, the
        optimizer state it applies them with). On update steps the rank sends its gradients plus
        its accumulators, whose sum over ranks the optimizer gets with its accumulators zeroed;
        between them the rank's own gradients, unsummed: the round is skipped in its callback."""
        if not contributes:  # its zero row's gradients may hold NaN
            grads = [jnp.zeros_like(g) for g in grads]
        accumulated = [self._state[i] for i in self._places]
        sent = [jnp.where(self.summing, g + accumulation.in_gradient_scale(a, self._optimizer).astype(g.dtype), g)
                for g, a in zip(grads, accumulated)]
        summed, token = bucket_sum(sent, True, sequence=accumulation.ConditionalRounds(sequence, 0),
                                   only_if=self.summing)
        state = list(self._state)
        for i, a in zip(self._places, accumulated):
            state[i] = jnp.where(self.summing, jnp.zeros_like(a), a)
        return summed, token, state


def platform_refusal(platform):
    """The refusal for a JAX `platform` the JAX step cannot run on, or None for the CPU and GPUs
    (whose gradients the step copies to the host for MPI)."""
    if platform in ("cpu", "gpu"):
        return None
    return (f"tnt.Model on Keras' JAX backend runs on CPUs and GPUs only yet, and this rank's JAX runs on "
            f"{platform!r}. Set JAX_PLATFORMS=cpu (or cuda) for the job, or use KERAS_BACKEND=tensorflow.")
