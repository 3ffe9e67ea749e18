"""What a TensorFlow step changes while it is traced, to make the wrapped model's step global: the
step's state (its micro-batch, the global batch size, the rank's share), the optimizers' loss
scaling and apply, the metrics' increments, synchronized BatchNormalization's moments, and the
compiled losses' global terms (see `step.py`)."""

import contextlib

import keras
import numpy as np
import tensorflow as tf
# Keras computes synchronized BatchNormalization's moments in a private function;
# tests/test_keras_internals.py checks it.
from keras.src.backend.tensorflow import nn as keras_tensorflow_nn

from tarantella.backends import accumulation, loss_terms, moments
from tarantella.runtime.kinds import Collective

class StepState:
    """What one traced step knows about the global batch, and the hooks it installs."""

    def __init__(self, samples, has_samples, runner, loss_optimizer, sequence):
        self.samples = samples  # the rank's sample count m (an integer scalar)
        self.has_samples = has_samples
        self._loss_optimizer = loss_optimizer
        self._sequence = sequence
        # Set when the step scaled its loss by the share (traced before backprop and apply).
        self.loss_weighted = False
        # The global batch size B (float64), once a collective of the step has summed it.
        self._global_samples = None
        # Where the loss was divided by a guess of B, because nothing before backprop needed it.
        self._loss_divisor = None
        self._runner = runner
        self._per_batch = set()  # ids of metric variables fed one scalar per step
        self.results = {}  # id(result tensor) -> (metric, key or None)
        # The optimizers that accumulate gradients (accumulation.py), each with whether this
        # micro-step updates, a traced bool: the step's opening agrees on them.
        self._accumulating = []
        # An output of each conditional gradient round: the collectives after them wait for them.
        self.conditional_rounds = []

    @property
    def global_samples(self):
        """B; asked for before any collective of the step gave it, it opens the step."""
        if self._global_samples is None:
            self._global_samples = self._runner.open_step(self._sequence, self.samples,
                                                          [summing for _, summing in self._accumulating])
        return self._global_samples

    @global_samples.setter
    def global_samples(self, value):
        self._global_samples = value

    @property
    def share(self):
        """The rank's share m/B of the global batch."""
        return tf.math.divide_no_nan(tf.cast(self.samples, tf.float64), self.global_samples)

    @property
    def inverse_share(self):
        return tf.math.divide_no_nan(self.global_samples, tf.cast(self.samples, tf.float64))

    def fed_per_batch(self, variable):
        return id(variable) in self._per_batch

    @contextlib.contextmanager
    def tracing(self, metrics, optimizers, compile_loss):
        with contextlib.ExitStack() as stack:
            for metric in metrics:
                stack.enter_context(_instance_override(metric, "update_state", self._watch_update(metric)))
                stack.enter_context(_instance_override(metric, "result", self._watch_result(metric)))
            for optimizer in optimizers:
                k = accumulation.steps(optimizer)
                if k:
                    self._accumulating.append(
                        (optimizer, accumulation.is_update_step(optimizer._iterations.value, k)))
                stack.enter_context(_instance_override(optimizer, "apply", self._reduced_apply(optimizer)))
            if self._loss_optimizer is not None:
                stack.enter_context(_instance_override(self._loss_optimizer, "scale_loss",
                                                       self._share_weighted_scale_loss(self._loss_optimizer)))
            if compile_loss is not None and getattr(compile_loss, "built", False):
                stack.enter_context(self._global_loss_terms(compile_loss))
            stack.enter_context(_module_override(keras_tensorflow_nn, "_compute_moments_sync",
                                                 self._global_moments))
            yield

    def recompute(self, leaves, combined_numbers):
        """The step's log values, with metric results read again from the combined state."""
        fresh = {}
        out = []
        for index, value in enumerate(leaves):
            if id(value) in self.results:
                metric, result_key = self.results[id(value)]
                if id(metric) not in fresh:
                    fresh[id(metric)] = metric.result()
                result = fresh[id(metric)]
                out.append(result[result_key] if result_key is not None else result)
            else:
                out.append(combined_numbers.get(index, value))
        return out

    # -- hooks ------------------------------------------------------------------------------

    def _watch_update(self, metric):
        original = metric.update_state
        per_batch_kind = isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum))

        def update_state(*args, **kwargs):
            values = args[0] if args else kwargs.get("values")
            weight = args[1] if len(args) > 1 else kwargs.get("sample_weight")
            if per_batch_kind and weight is None and _rank(values) == 0:
                self._per_batch.update(id(v) for v in metric.variables)
            return original(*args, **kwargs)

        return update_state

    def _watch_result(self, metric):
        original = metric.result

        def result():
            value = original()
            if isinstance(value, dict):
                for key, tensor in value.items():
                    self.results[id(tensor)] = (metric, key)
            else:
                self.results[id(value)] = (metric, None)
            return value

        return result

    def _share_weighted_scale_loss(self, optimizer):
        original = optimizer.scale_loss

        def scale_loss(loss):
            self.loss_weighted = True
            # Where the loss's terms needed B, the step has opened; an accumulation step opens, as
            # it must agree on whether it sums before its gradient round would.
            if self._global_samples is not None or self._decision(optimizer) is not None:
                return original(loss) * tf.cast(self.share, loss.dtype)
            self._loss_divisor = self._runner.guessed_global_samples(self.samples)
            weight = tf.math.divide_no_nan(tf.cast(self.samples, tf.float64), self._loss_divisor)
            return original(loss) * tf.cast(weight, loss.dtype)

        return scale_loss

    def _reduced_apply(self, optimizer):
        original = optimizer.apply

        def apply(grads, trainable_variables=None):
            grads = list(grads)
            variables = list(trainable_variables if trainable_variables is not None
                             else optimizer._trainable_variables)
            if self._decision(optimizer) is not None:
                weighted = self.loss_weighted and optimizer is self._loss_optimizer
                return original(self._accumulated(optimizer, grads if weighted else _weighted(grads, self.share),
                                                  variables), trainable_variables)
            if self.loss_weighted and optimizer is self._loss_optimizer:
                # Weighted already; a rank without samples sends zeros (its zero row's gradients
                # may hold NaN), set where the bucket is handed over: no pass over the gradients.
                divisor, self._loss_divisor = self._loss_divisor, None
                if all(g is None for g in grads):
                    divisor = None  # no round to open the step: a later collective opens it
                reduced = self._runner.reduce_gradients(grads, variables, contributes=self.has_samples,
                                                        loss_divisor=divisor)
            else:
                reduced = self._runner.reduce_gradients(_weighted(grads, self.share), variables)
            return original(reduced, trainable_variables)

        return apply

    def _decision(self, optimizer):
        """(index, traced bool: whether this micro-step updates) of an accumulating optimizer, else None."""
        for index, (accumulating, summing) in enumerate(self._accumulating):
            if accumulating is optimizer:
                return index, summing
        return None

    def _accumulated(self, optimizer, grads, variables):
        """What an accumulating optimizer applies (accumulation.py): on an update step the sum over
        ranks of each rank's share-weighted gradients plus its accumulators, which are zeroed;
        between updates the rank's own gradients, unsummed, and no round."""
        index, summing = self._decision(optimizer)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        # Dense, as serial Keras adds them to its accumulators; zeros where the rank has no samples
        # (its zero row's gradients may hold NaN).
        own = [tf.convert_to_tensor(grads[i]) for i in present]
        own = tf.cond(self.has_samples, lambda: own, lambda: [tf.zeros_like(g) for g in own])
        if not optimizer.built:  # as its apply would build it, in its first trace
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
        accumulators = accumulation.accumulators(optimizer, [variables[i] for i in present])

        def summed():
            sent = [g + tf.cast(accumulation.in_gradient_scale(a.value, optimizer), g.dtype)
                    for g, a in zip(own, accumulators)]
            with tf.control_dependencies(sent):
                for accumulator in accumulators:
                    accumulator.assign(tf.zeros_like(accumulator.value))
            return self._runner.reduce_gradients(sent, [variables[i] for i in present],
                                                 sequence=accumulation.ConditionalRounds(self._sequence, index))

        # TensorFlow orders a conditional only by its inputs, and a rank without samples sends no
        # input that waits for the opening: the round waits for it explicitly (and later
        # collectives for the round, see step.py).
        with tf.control_dependencies([self.global_samples]):
            applied = tf.cond(summing, summed, lambda: [tf.identity(g) for g in own])
        applied = applied if isinstance(applied, (list, tuple)) else [applied]
        self.conditional_rounds.append(applied[0])
        out = [None] * len(grads)
        for i, g in zip(present, applied):
            out[i] = g
        return out

    def _global_moments(self, x, axes, keepdims):
        """Synchronized BatchNormalization: the mean and variance of the whole global batch
        (backends/moments.py), from one float64 allreduce per layer call, in forward order; its
        gradient is the allreduce of the incoming gradients, in backward order."""
        local, shape, axes = moments.local_sums(x, axes, self._runner.widest_float, self.has_samples)
        runner = self._runner
        share = self.share
        step = self

        @tf.custom_gradient
        def allreduce(vector):
            def grad(upstream):
                what = Collective.BATCHNORM_GRADIENTS
                if step.loss_weighted:  # backprop started from the share-weighted loss
                    return runner._allreduce(tf.where(step.has_samples, upstream, tf.zeros_like(upstream)), what)
                # Each rank's gradients are weighted by its share only after backprop (in apply), so
                # the upstream gradients are weighted here, and the weight is taken out again.
                return tf.math.divide_no_nan(runner._allreduce(upstream * share, what), share)
            return runner._allreduce(vector, Collective.BATCHNORM_MOMENTS), grad

        return moments.global_moments(allreduce(local), shape, axes, keepdims, x.dtype)

    def _global_loss_terms(self, compile_loss):
        def sum_over_ranks(local):
            vector = tf.reshape(tf.cast(local, tf.float64), [1])
            return self._runner._allreduce(vector, Collective.LOSS_DIVISOR)[0]

        return loss_terms.global_loss_terms(compile_loss, lambda: self.inverse_share, sum_over_ranks)


@contextlib.contextmanager
def _instance_override(obj, name, replacement):
    """Replaces a method on one object while a step is traced (Keras objects track attributes
    they are given, so the instance dictionary is used directly)."""
    obj.__dict__[name] = replacement
    try:
        yield
    finally:
        obj.__dict__.pop(name, None)


@contextlib.contextmanager
def _module_override(module, name, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _weighted(grads, share):
    """Each gradient times the rank's share. Without samples the share is 0 and the products
    are exact zeros, also where the zero row's gradients hold NaN (BatchNormalization of one
    row): multiply_no_nan gives 0 * NaN = 0."""
    out = list(grads)
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            out[i] = tf.IndexedSlices(tf.math.multiply_no_nan(g.values, tf.cast(share, g.values.dtype)),
                                      g.indices, g.dense_shape)
        elif g is not None:
            out[i] = tf.math.multiply_no_nan(g, tf.cast(share, g.dtype))
    return out


def _rank(value):
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is None:
        return np.ndim(value)
    return len(shape) if getattr(shape, "rank", len(shape)) is not None else None
