"""The global step on Keras' TensorFlow backend: a Keras step on each rank's micro-batch, combined into the serial step.

`tnt.Model` runs the wrapped model's own `train_step`, `test_step` and `predict_step`
(Keras' built-in ones, or the user's overrides) inside a `TensorFlowStep`. While the
step is traced, it makes four things global:

1. the global batch size B: the first collective of the step sums the ranks' sample counts m;
2. gradients: every optimizer the model holds sums, before it updates, the gradients of
   all ranks, each weighted by its rank's share m/B of the global batch. For a loss that
   is a mean over the micro-batch this is the gradient of the serial step. Keras' own
   train_step differentiates `optimizer.scale_loss(loss)`: there the share weights that
   scalar, which spares a pass over every gradient. Where nothing before backprop needs
   B, the step does not open with a collective of its own: the rank divides by the global
   batch size of its dataset, and the gradient round's first message sums the counts; a rank
   whose guess was wrong (a last incomplete batch) rescales its buckets;
3. compiled losses that are not a mean over samples (masked entries, `reduction="sum"`)
   are rescaled so that the same share weighting still gives the serial loss: a masked
   mean (the output's mask, `ignore_class`, or both) is divided by the global count of
   unmasked entries, not the rank's, and a `"mean_with_sample_weight"` loss by the global
   sum of weights;
4. metrics: every metric of the model starts the step at zero; afterwards the increments
   of all ranks are summed (one allreduce) and added to the state the metric had. A mean
   tracker fed one scalar per step (e.g. the batch loss) is weighted by the share instead.
   Logs that read a metric's result are recomputed from the combined state; any other
   number the step returns becomes its share-weighted sum over ranks.

With XLA (`jit_compile=True`, or Keras' "auto" on a GPU) the step's ops are traced inside an
XLA JIT scope: TensorFlow clusters what XLA can compile (the forward and backward pass, the
weighting, the update) and leaves the collectives, which XLA cannot compile, between the
clusters. A bucket then leaves when the cluster that computes it ends, not as backprop reaches it.

Every collective of a step is a stateful op, so TensorFlow runs them in program order,
the same on every rank. The step's first collective (the allreduce of sizes that opens it,
or the gradient round) also carries the ranks' agreement on the step's whole sequence of
collectives, which then need none of their own.
A rank without samples (a global batch smaller than the number of ranks) runs the step on
one zero row, because TensorFlow cannot run every layer on zero rows, and contributes
nothing.
"""

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from tarantella.backends import accumulation, metric_sums, rows
from tarantella.backends.base import Step
from tarantella.backends.tensorflow import devices
from tarantella.backends.tensorflow import gradients
from tarantella.backends.tensorflow.gradients import GradientAllreduce
from tarantella.backends.tensorflow.traced_step import StepState
from tarantella.runtime import events
from tarantella.runtime.kinds import Collective


class TensorFlowStep(Step):
    """Runs the wrapped model's steps so that every rank gets the serial step's results."""

    backend_name = "TensorFlow"
    custom_steps = True
    rank_local_logs = True
    custom_training_loops = True
    collectives_inside_xla = False
    # Without a global seed, Keras' tf.random.shuffle of arrays draws a new order in each process.
    keras_array_shuffle_differs_per_process = True
    keras_accepts_synchronized_batch_normalization = True

    @classmethod
    def keras_iterators_per_epoch(cls, batches_known):
        # One at the start of every epoch and, where the dataset's cardinality tells the number of
        # batches, another one (unused) as soon as an epoch has seen them all.
        return 2 if batches_known else 1

    @classmethod
    def configure_devices(cls, share, threads):
        devices.configure(share, threads, computes_steps=True)

    @classmethod
    def sum_loop_gradients(cls, grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks):
        return gradients.loop_sum(grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks)

    @classmethod
    def snapshot(cls, variables, buffers=None):
        # On the host, a read that is held: TensorFlow writes an update of a buffer that someone
        # still reads into a new buffer, so the held read is the snapshot, nothing is copied now,
        # and NumPy reads it in place. On a GPU, held reads would double the state's device memory
        # at the next update: copied to the host instead.
        reads = [tf.identity(variable.value) for variable in variables]
        if all("CPU" in read.device for read in reads):
            return reads
        return super().snapshot(variables, buffers)

    @classmethod
    def replayed_train_function(cls, model, train_function, replayer):
        def train_or_replay(iterator):
            if replayer.over():
                model.train_function = train_function  # replaying is over: the step itself from now on
                return train_function(iterator)
            if hasattr(iterator, "get_next"):
                for _ in range(model.steps_per_execution):
                    iterator.get_next()  # the batch the uninterrupted run trained on here
            return replayer.replayed(model.steps_per_execution)
        return train_or_replay

    def __init__(self, communicator, reducer, model, threshold_bytes):
        self._comm = communicator
        self._model = model
        self._gradient_allreduce = GradientAllreduce(reducer, threshold_bytes)
        # (metric variable, rank-local copy) pairs, kept only while a callback asks for the
        # rank's own values (tnt.keras.callbacks.Callback(aggregate_logs=False)).
        self.local_metric_state = None
        # While a step is traced: descriptions of its collectives, which its opening agrees on,
        # and the step's StepState.
        self._sequence = None
        self._step = None
        # The global batch size of the data fit runs on, where known (see expect_global_batch_size).
        self._expected_global_samples = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                                    name="tnt_expected_global_samples")
        self._unknown_length_specs = {}  # kind of step -> spec of its global batches (expect_unknown_length)
        self._xla = False
        self._arrived = None  # while a step is traced: the timestamp of its batch's arrival (or 0)

    def compile_between_collectives(self, xla):
        self._xla = bool(xla)
        if self._xla:
            # Grappler's remapper would fuse layers' ops (MatMul, BiasAdd and ReLU into _FusedMatMul)
            # before XLA clusters the graph, into ops XLA cannot compile: the forward pass would run
            # outside XLA. It leaves the fusing to XLA where XLA compiles everything (jit_compile).
            tf.config.optimizer.set_experimental_options({"remapping": False})

    def train(self, data):
        keras_own_step = type(self._model).train_step is keras.Model.train_step
        return self._run("training", self._model.train_step, data,
                         loss_optimizer=getattr(self._model, "optimizer", None) if keras_own_step else None)

    def test(self, data):
        return self._run("test", self._model.test_step, data)

    def predict(self, data):
        """Every rank gets every prediction, in the order of the global batch."""
        data, samples = self._batch_outside_xla(data)
        with self._inside_xla():
            y_pred = self._model.predict_step(data)
        leaves = [leaf[:samples] for leaf in tf.nest.flatten(y_pred)]
        gathered = tf.numpy_function(self._gather_predictions, leaves, [t.dtype for t in leaves],
                                     stateful=True, name="tnt_gather_predictions")
        for full, local in zip(gathered, leaves):
            full.set_shape([None] + local.shape[1:])
        return tf.nest.pack_sequence_as(y_pred, gathered)

    def wrap_function(self, kind, function):
        """Keras' train, test or predict function (`kind`), as it runs on this backend: `predict`
        gathers inside the step; a training or test function that finds data of unknown length
        exhausted first leaves what serial Keras' call does (see `expect_unknown_length`)."""
        if kind == "predict":
            return function

        def ending_as_keras_does(*arguments):
            try:
                return function(*arguments)
            except tf.errors.OutOfRangeError:
                spec = self._unknown_length_specs.get(kind)
                if spec is not None:
                    _keras_call_on_exhausted_data(self._model, kind, spec)
                raise

        return ending_as_keras_does

    def expect_unknown_length(self, kind, global_batch_spec):
        """Tells the coming `kind` ("train" or "test") steps the spec of their global batches where
        TensorFlow cannot tell the data's length (else None).

        Keras' loop then ends each pass with a call that finds the data exhausted, and in serial
        Keras that call has effects: the ops of its step that need no batch run before the batch
        is found missing, among them the counts that metrics and the loss tracker add from a
        static batch size (Keras 3.15: a pass of n full batches logs n/(n+1) of its mean). A rank's
        micro-batches have no static size, so tarantella's own call adds nothing: after it, the
        same call of serial Keras' own function runs on an exhausted input of the global spec, and
        only what it did to the metrics is kept."""
        batched = [spec for spec in tf.nest.flatten(global_batch_spec or ()) if spec.shape.rank]
        static = batched and all(spec.shape[0] is not None for spec in batched)
        self._unknown_length_specs[kind] = global_batch_spec if static else None

    def optimizers(self):
        """Every optimizer the wrapped model holds: `optimizer` and any other attribute (a GAN's
        `d_optimizer`, ...); an optimizer wrapped by another (LossScaleOptimizer) counts once."""
        found = {}
        for value in [getattr(self._model, "optimizer", None), *vars(self._model).values()]:
            if isinstance(value, keras.optimizers.Optimizer):
                found[id(value)] = value
        inner = {id(getattr(o, "inner_optimizer", None)) for o in found.values()}
        return [o for key, o in found.items() if key not in inner]

    # -- one step ---------------------------------------------------------------------------

    def _run(self, kind, step_function, data, loss_optimizer=None):
        """`loss_optimizer`: the optimizer whose `scale_loss` the step differentiates (Keras' own
        train_step), or None."""
        data, samples = self._batch_outside_xla(data)
        data, self._arrived = _timestamped(data, samples)
        has_samples = samples > 0
        sequence = self._sequence = [f"a {kind} step"]
        try:
            step = self._step = StepState(samples, has_samples, self, loss_optimizer, sequence)
            with self._inside_xla():
                return self._traced_step(step, step_function, data)
        finally:
            self._sequence = self._step = self._arrived = None

    def _inside_xla(self):
        return tf.xla.experimental.jit_scope() if self._xla else contextlib.nullcontext()

    def _batch_outside_xla(self, data):
        """The batch and its sample count (`_at_least_one_row`). With XLA they are kept out of its
        clusters, through which TensorFlow would otherwise let the count, and so the step's
        opening and everything waiting for the batch, wait for the forward pass."""
        if not self._xla:
            return _at_least_one_row(data)
        with tf.xla.experimental.jit_scope(compile_ops=False):
            return _at_least_one_row(_identities(data))

    def _traced_step(self, step, step_function, data):
        metrics = _unique(self._model.metrics)
        variables = _unique([v for metric in metrics for v in metric.variables])
        has_samples = step.has_samples
        # Only once a batch has arrived: TensorFlow may run these before the inlined step's input,
        # and the call that finds a dataset of unknown length exhausted would zero the epoch's metrics.
        with tf.control_dependencies([step.samples]):
            saved = [tf.identity(v.value) for v in variables]
            for variable in variables:
                variable.assign(tf.zeros(variable.shape, variable.dtype))
        with step.tracing(metrics, self.optimizers(), getattr(self._model, "_compile_loss", None)):
            logs = step_function(data)
        known = {id(v) for v in variables}
        created = [v for m in _unique(self._model.metrics) for v in m.variables if id(v) not in known]
        if created:
            raise RuntimeError(
                f"The step created metric state while it ran ({created[0].path}), so tarantella could not "
                "combine it across ranks. Build the model's metrics before fit: call the model once on a "
                "batch, or create the metrics in __init__.")
        if not isinstance(logs, dict):
            raise TypeError(f"{type(self._model).__name__}'s step returned {type(logs).__name__}; Keras steps "
                            "return a dict of logs, e.g. {m.name: m.result() for m in self.metrics}.")
        increments = [v.value for v in variables]
        self._record_local(variables, increments, has_samples)

        leaves = tf.nest.flatten(logs)
        numbers = {i: leaf for i, leaf in enumerate(leaves) if id(leaf) not in step.results and _is_number(leaf)}
        values = increments + list(numbers.values())
        weights = [step.share if step.fed_per_batch(v) else None for v in variables] + [step.share] * len(numbers)
        with tf.control_dependencies(step.conditional_rounds):
            summed = self._allreduce(tf.where(has_samples, metric_sums.flat(values, self.widest_float, weights), 0.0)
                                     if values else tf.zeros([0], tf.float64), Collective.LOSSES_AND_METRICS)
        summed_values = iter(metric_sums.pieces(summed, values) if values else [])
        for variable, before in zip(variables, saved):
            variable.assign(before + next(summed_values))
        combined = {i: next(summed_values) for i in numbers}
        return tf.nest.pack_sequence_as(logs, step.recompute(leaves, combined))

    def _record_local(self, variables, increments, has_samples):
        """Advances the rank-local copy of the metric state by this micro-batch alone."""
        if self.local_metric_state is None:
            return
        shadows = dict((id(v), shadow) for v, shadow in self.local_metric_state)
        for variable, increment in zip(variables, increments):
            shadow = shadows.get(id(variable))
            if shadow is not None:
                shadow.assign_add(tf.where(has_samples, increment, tf.zeros_like(increment)))

    def open_step(self, sequence, samples, summing=()):
        """The step's opening: the global batch size (float64), summed by a collective of its own
        that also agrees on the step's `sequence` of collectives (complete before it first runs),
        with the rounds of accumulating optimizers in it only where their `summing` (traced bools,
        accumulation.py) is True."""
        opening = functools.partial(self._open_step, f"{Collective.STEP_OPENING.what} of {sequence[0]}",
                                    sequence)
        global_samples = tf.cast(tf.numpy_function(opening, [tf.cast(samples, tf.int64), *summing], tf.int64,
                                                   stateful=True, name="tnt_open_step"), tf.float64)
        global_samples.set_shape([])
        return global_samples

    def _open_step(self, what, sequence, samples, *summing):
        described = accumulation.described(sequence, [bool(flag) for flag in summing])
        return np.int64(self._comm.open_step(what, "; ".join(described), int(samples)))

    def expect_global_batch_size(self, size):
        """The global batch size of the dataset the next steps train on (None: not known)."""
        self._expected_global_samples.assign(float(size or 0))

    def guessed_global_samples(self, samples):
        """What a step without an opening divides its loss by: the expected global batch size, or,
        where none is known, this rank's sample count times the number of ranks. Both depend on
        the step's batch alone, never on the steps before, so a resumed job repeats the same
        arithmetic bit for bit."""
        expected = self._expected_global_samples.read_value()
        return tf.where(expected > 0, expected, tf.cast(samples, tf.float64) * self._comm.size)

    def _allreduce(self, vector, kind):
        """The sum of a float64 vector over ranks (a collective of `kind`, a Collective); inside a
        traced step, part of its sequence."""
        agreed = self._sequence is not None
        if agreed:
            self._step.global_samples  # the step's first collective is its opening, which agrees
            self._sequence.append(f"{kind.what} of float64{vector.shape}")
        summed = tf.numpy_function(functools.partial(self._comm.allreduce_sum, what=kind, agreed=agreed),
                                   [vector], tf.float64, stateful=True, name="tnt_allreduce")
        summed.set_shape(vector.shape)
        return summed

    def _gather_predictions(self, *arrays):
        return self._comm.allgather_interleaved_rows(list(arrays), Collective.PREDICTIONS)

    def reduce_gradients(self, grads, variables, contributes=None, loss_divisor=None, sequence=None):
        """The sum over ranks of each rank's share-weighted gradients (None stays None); a rank
        whose `contributes` is False adds zeros.

        With `loss_divisor` (the guess of the global batch size the rank's loss was divided
        by; the step has no opening), the round opens the step and sets its global batch size.
        `sequence`: where the round describes itself in the step's sequence, if not at its end
        (accumulation.ConditionalRounds)."""
        if loss_divisor is None:
            return self._gradient_allreduce(grads, variables, contributes=contributes,
                                            step_sequence=self._sequence if sequence is None else sequence)
        step = self._step
        reduced, global_samples = self._gradient_allreduce(
            grads, variables, contributes=contributes, step_sequence=self._sequence,
            opening=(step.samples, loss_divisor, self._arrived))
        step.global_samples = global_samples
        return reduced


def _keras_call_on_exhausted_data(model, kind, global_batch_spec):
    """What serial Keras' own train or test function does to the metrics of `model` when it is
    called on exhausted data of `global_batch_spec`; every other variable is left as it was."""
    if kind == "train":
        model.make_train_function()
        function = model.train_function
    else:
        model.make_test_function()
        function = model.test_function
    metric_state = {id(v) for metric in model.metrics for v in metric.variables}
    optimizers = [getattr(model, "optimizer", None)]
    others = _unique([v for v in model.variables if id(v) not in metric_state] +
                     [v for o in optimizers if o is not None for v in o.variables])
    kept = [(variable, tf.identity(variable.value)) for variable in others]
    exhausted = tf.data.Dataset.from_generator(lambda: iter(()), output_signature=global_batch_spec)
    try:
        function(iter(exhausted))
    except tf.errors.OutOfRangeError:
        pass
    for variable, value in kept:
        variable.assign(value)


def _timestamped(data, samples):
    """The batch, and the time it arrived (its `samples` count known) for the timeline, or 0 without
    one. The step's computation waits for the timestamp: with one inter-op thread TensorFlow may
    otherwise run the forward pass first (with XLA, all of it at once) and take the time after it."""
    if events.observer is None:
        return data, tf.constant(0.0, tf.float64)
    with tf.control_dependencies([samples]):
        arrived = tf.timestamp()
    with tf.control_dependencies([arrived]):
        return _identities(data), arrived


def _identities(data):
    return tf.nest.map_structure(lambda leaf: tf.identity(leaf) if isinstance(leaf, tf.Tensor) else leaf, data)


def _at_least_one_row(data):
    """The batch and its number of rows m (a tensor); with m == 0 the batch becomes one zero row
    (backends/rows.py) behind a graph conditional."""
    leaves = tf.nest.flatten(data)
    batched = [i for i, leaf in enumerate(leaves) if isinstance(leaf, tf.Tensor) and leaf.shape.rank]
    # The count must wait for the input even where the batch size is static (drop_remainder), when
    # tf.shape folds to a constant: the metric zeroing waits for it, and the call that finds a dataset
    # of unknown length exhausted must not zero the epoch's metrics.
    with tf.control_dependencies([t for t in tf.nest.flatten(data, expand_composites=True)
                                  if isinstance(t, tf.Tensor)]):
        if not batched:
            return data, tf.identity(tf.constant(1))
        tensors = [leaves[i] for i in batched]
        samples = tf.identity(tf.shape(tensors[0])[0])
    if any(t.shape[0] is not None and t.shape[0] > 0 for t in tensors):
        return data, samples  # a static, non-empty batch needs no guard
    guarded = tf.cond(samples > 0, lambda: [tf.identity(t) for t in tensors],
                      lambda: [rows.zero_row(t) for t in tensors])
    for new, old in zip(guarded, tensors):
        new.set_shape([None] + old.shape[1:])
    for i, new in zip(batched, guarded):
        leaves[i] = new
    return tf.nest.pack_sequence_as(data, leaves), samples


def _unique(items):
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def _is_number(value):
    return isinstance(value, (tf.Tensor, tf.Variable)) and (value.dtype.is_floating or value.dtype.is_integer)
