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
   output buffer is allocated. On a GPU the buckets are an ordered `io_callback`'s instead:
   JAX copies them to the host and their sums back;
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
loss's and backprop's callbacks, and the metric sum takes a piece of its result. The worker
issues every collective of the process in one fixed order, so every rank issues the same
collectives in the same order.

The gradient sum runs after the whole backprop: it does not overlap with it as TensorFlow's and
PyTorch's buckets do. A hand-over per bucket as XLA computes it, with one last callback waiting
for the round, measured no faster on 2 ranks sharing 2 cores (0.98-1.02 of this step, MLP) and
would rely on XLA never copying a buffer while the worker still writes it: not done. Two earlier forms cost more than the ring allreduce itself, for the MLP
of benchmarks/scaling.py (40 MB of gradients): an `io_callback`, which JAX copies its arguments
into with a `device_put` (on a rank bound to a single core that copy waited for XLA's only
thread, the one blocked in the callback: the job hung, tests/test_jax_backend.py runs such a
job) and its results out of; then a `buffer_callback` writing into fresh output buffers, whose
pages the kernel zeroes and faults in anew each step.

Predictions are gathered outside the jitted step (`wrap_function`): the size of the
global batch is not known to the trace, and a gather needs it for its result's shape.

A rank without samples (a global batch smaller than the number of ranks) runs the step on one
zero row and contributes exact zeros; it keeps its non-trainable state as it was.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback
# Keras' JAX backend computes BatchNormalization's moments here, and refuses synchronized=True;
# tests/test_keras_internals.py checks that the layer still calls it.
from keras.src.backend.jax import nn as keras_jax_nn

from tarantella.backends import fusion, loss_terms, metric_sums, moments
from tarantella.backends.base import Step
from tarantella.backends.rows import at_least_one_row
from tarantella.backends.jax import devices as jax_devices
from tarantella.backends.tensorflow import devices as tensorflow_devices
from tarantella.runtime.kinds import Collective

_MOMENTS = Collective.BATCHNORM_MOMENTS
_MOMENTS_GRADIENTS = Collective.BATCHNORM_GRADIENTS


class JaxStep(Step):
    """Builds the pure train, test and predict steps that Keras' JAX trainer jits."""

    backend_name = "JAX"
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
                    "calls), or use the TensorFlow backend, where it runs inside tf.function.")
            leaf = np.asarray(leaf)
        return leaf

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
        # On the CPU the gradient sum reads and writes XLA's own buffers; a GPU's must be copied.
        self._gradients_in_host_memory = jax.default_backend() == "cpu"

    def expect_global_batch_size(self, size):
        """Not needed here: every step opens with the sum of the ranks' sample counts."""

    def optimizers(self):
        """The optimizer Keras' built-in step applies (the only step JAX runs distributed)."""
        optimizer = getattr(self._model, "optimizer", None)
        return [optimizer] if isinstance(optimizer, keras.optimizers.Optimizer) else []

    # -- the steps, with Keras' JAX trainer's signatures --------------------------------------

    def train(self, state, data):
        trainable, non_trainable, optimizer_state, metric_state = state
        model = self._model
        data, samples = at_least_one_row(data)
        sequence = ["a training step"]
        global_samples = self._open_step(sequence, samples)
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
        grads, summed = self._sum_gradients(sequence, grads, contributes=samples > 0)
        trainable, optimizer_state = model.optimizer.stateless_apply(optimizer_state, grads, trainable)
        _, increments = model._update_metrics_variables(increments, unscaled_loss, x, y, y_pred, sample_weight)
        metric_state = self._add_global_increments(sequence, metric_state, increments, samples > 0, after=summed)
        if samples > 0:
            non_trainable = new_non_trainable
        return self._logs(metric_state), (trainable, non_trainable, optimizer_state, metric_state)

    def test(self, state, data):
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
        if samples > 0:
            non_trainable = new_non_trainable
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

    def _open_step(self, sequence, samples):
        """B, the sum of the ranks' `samples`; the opening agrees on `sequence`, which the
        rest of the trace completes before the step first runs."""
        what = f"{Collective.STEP_OPENING.what} of {sequence[0]}"

        def open_step():
            return np.int32(self._comm.open_step(what, "; ".join(sequence), samples))

        return io_callback(open_step, jax.ShapeDtypeStruct((), jnp.int32), ordered=True)

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

    def _sum_gradients(self, sequence, grads, contributes):
        """The sum over ranks of the (share-weighted) `grads`, and one summed bucket that later
        collectives of the step take as an input, so that they run after this one; a rank that
        does not contribute sends zeros (its zero row's gradients may hold NaN)."""
        wire = [g.astype(fusion.wire_dtype(g.dtype.name)) for g in grads]
        layout = fusion.BucketLayout([g.size for g in wire], [g.dtype.name for g in wire], self._threshold_bytes,
                                     list(reversed(range(len(grads)))))
        members = [[index for index, _, _ in bucket_members] for _, _, bucket_members in layout.buckets]
        if not members:
            return grads, None
        # A gradient alone in its bucket (every one that reaches the fusion threshold) is handed
        # over as it is; only the small ones are concatenated.
        buckets = [wire[bucket[0]] if len(bucket) == 1 else jnp.concatenate([jnp.ravel(wire[i]) for i in bucket])
                   for bucket in members]
        # The callback below is in no ordered chain of callbacks: only its inputs keep it after the
        # step's earlier collectives. A rank that sends zeros passes its gradients too, unread.
        waited_for = () if contributes else tuple(buckets)
        if not contributes:
            buckets = [jnp.zeros_like(b) for b in buckets]
        sequence.append(fusion.round_description(layout.names()))
        # Each bucket is summed in place, in the buffer XLA computed it in (aliased from the
        # callback's input to its output): the worker reads and writes it there, so no bucket is
        # copied and no fresh output buffer is faulted in (for the MLP of benchmarks/scaling.py,
        # faulting in 40 MB of output each step cost more than its ring allreduce).
        specs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buckets]
        if self._gradients_in_host_memory:
            summed = buffer_callback(self._sum_in_place, specs, has_side_effect=True,
                                     input_output_aliases={i: i for i in range(len(buckets))})(*buckets, *waited_for)
        else:  # a GPU's buffers: JAX copies the buckets to the host and the sums back
            summed = io_callback(functools.partial(self._sum_copies, len(buckets)), specs, *buckets, *waited_for,
                                 ordered=True)
        result = list(grads)
        for (_, _, bucket_members), total in zip(layout.buckets, summed):
            if len(bucket_members) == 1:
                result[bucket_members[0][0]] = total.astype(grads[bucket_members[0][0]].dtype)
                continue
            for i, offset, size in bucket_members:
                result[i] = total[offset:offset + size].reshape(grads[i].shape).astype(grads[i].dtype)
        return result, jnp.ravel(summed[0])[:1]

    def _sum_in_place(self, context, sums, *buckets_and_unread):
        """Sums every bucket over ranks where it lies: each of `sums` is XLA's buffer of its
        bucket, valid while this runs."""
        self._sum_flat([np.asarray(total).reshape(-1) for total in sums])

    def _sum_copies(self, count, *buckets_and_unread):
        """The sums over ranks of the first `count` arrays, host copies of a GPU's buckets."""
        buckets = buckets_and_unread[:count]
        sums = [np.array(bucket).reshape(-1) for bucket in buckets]
        self._sum_flat(sums)
        return [total.reshape(np.shape(bucket)) for total, bucket in zip(sums, buckets)]

    def _sum_flat(self, arrays):
        """Sums each 1-D array over ranks in place, as one round of gradient buckets."""
        for index, array in enumerate(arrays):
            self._reducer.submit(index, len(arrays), array, agreed=True)
        self._reducer.collect()

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


def platform_refusal(platform):
    """The refusal for a JAX `platform` the JAX step cannot run on, or None for the CPU and GPUs
    (whose gradients the step copies to the host for MPI)."""
    if platform in ("cpu", "gpu"):
        return None
    return (f"tnt.Model on Keras' JAX backend runs on CPUs and GPUs only yet, and this rank's JAX runs on "
            f"{platform!r}. Set JAX_PLATFORMS=cpu (or cuda) for the job, or use KERAS_BACKEND=tensorflow.")
