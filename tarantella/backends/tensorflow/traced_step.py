"""What a TensorFlow step changes while it is traced, to make the wrapped model's step global: the
step's state (its micro-batch, the global batch size, the rank's share), the optimizers' loss
scaling and apply, the metrics' increments, synchronized BatchNormalization's moments, and the
compiled losses' global terms (see `step.py`)."""

import contextlib

import keras
import numpy as np
import tensorflow as tf
# Keras computes synchronized BatchNormalization's moments, and reduces a loss under its mask
# and sample weights, in private functions; tests/test_keras_internals.py checks both.
from keras.src.backend.tensorflow import nn as keras_tensorflow_nn
from keras.src.losses import loss as keras_loss

from tarantella.runtime.kinds import Collective

_keras_reduce_weighted_values = keras_loss.reduce_weighted_values

_MEAN_REDUCTIONS = ("mean", "sum_over_batch_size")


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

    @property
    def global_samples(self):
        """B; asked for before any collective of the step gave it, it opens the step."""
        if self._global_samples is None:
            self._global_samples = self._runner.open_step(self._sequence, self.samples)
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
            if self._global_samples is not None:  # the loss's terms needed B: the step has opened
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

    def _global_moments(self, x, axes, keepdims):
        """Synchronized BatchNormalization: the mean and variance of the whole global batch.

        Each rank takes its micro-batch's moments as serial Keras takes a batch's (two passes,
        tf.nn.moments), and the ranks combine them in float64, without the cancellation of a
        float32 sum of squares: one allreduce of (n * mean, n * (variance + mean^2), n) per layer
        call, in forward order; its gradient is the allreduce of the incoming gradients, in
        backward order."""
        mean, variance = [tf.cast(t, tf.float64) for t in tf.nn.moments(x, axes, keepdims=True)]
        count = tf.reduce_prod(tf.gather(tf.cast(tf.shape(x), tf.float64), axes)) * tf.ones_like(mean)
        shape = tf.shape(mean)
        flat = tf.concat([tf.reshape(t, [-1]) for t in (count * mean, count * (variance + tf.square(mean)), count)], 0)
        flat = tf.where(self.has_samples, flat, tf.zeros_like(flat))
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

        total, squares, count = [tf.reshape(t, shape) for t in tf.split(allreduce(flat), 3)]
        mean = tf.math.divide_no_nan(total, count)
        variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        mean, variance = tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    @contextlib.contextmanager
    def _global_loss_terms(self, compile_loss):
        terms = compile_loss._flat_losses  # Keras private; tests/test_keras_internals.py checks it
        originals = list(terms)
        terms[:] = [term._replace(loss=_GlobalLossTerm(term.loss, self)) for term in originals]
        try:
            yield
        finally:
            terms[:] = originals


class _GlobalLossTerm:
    """A compiled loss whose value, weighted by the rank's share, sums to the serial loss.

    Keras's `Loss.__call__` combines the output's mask with the mask its `call` puts on the
    per-entry losses (`ignore_class`), merges it with `sample_weight`, and hands all of it to
    `reduce_weighted_values`. That function is replaced during the call, so the rank's divisor
    is read from exactly what Keras divides by, whatever made the mask."""

    def __init__(self, loss, step):
        self._loss = loss
        self._step = step

    def __getattr__(self, name):
        return getattr(self._loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        step = self._step
        if getattr(self._loss, "reduction", "sum_over_batch_size") == "sum":
            value = self._loss(y_true, y_pred, sample_weight)
            return value * tf.cast(step.inverse_share, value.dtype)
        with _module_override(keras_loss, "reduce_weighted_values", self._reduce_globally):
            return self._loss(y_true, y_pred, sample_weight)

    def _reduce_globally(self, values, sample_weight=None, mask=None, reduction="sum_over_batch_size",
                         dtype=None):
        """Keras's reduction, rescaled from the rank's divisor to the global batch's."""
        value = _keras_reduce_weighted_values(values, sample_weight, mask, reduction, dtype)
        local = _local_divisor(values, sample_weight, mask, reduction, dtype)
        if local is None:
            return value  # a mean over the micro-batch's entries: the share is the right weight
        step = self._step
        local = tf.where(step.has_samples, local, 0.0)
        total = step._runner._allreduce(tf.reshape(local, [1]), Collective.LOSS_DIVISOR)[0]
        factor = tf.math.divide_no_nan(local, total) * step.inverse_share
        return value * tf.cast(factor, value.dtype)


def _local_divisor(values, sample_weight, mask, reduction, dtype):
    """What Keras's mean reduction divides the micro-batch's summed loss by (float64), or None
    where that is the number of entries, which the rank's share already accounts for."""
    if values.shape.rank == 0:
        return None  # Keras returns a scalar unreduced
    if reduction in _MEAN_REDUCTIONS:
        # A mask weights the unmasked entries by entries/unmasked: the mean of the unmasked ones.
        return None if mask is None else tf.reduce_sum(tf.cast(mask, tf.float64))
    if reduction == "mean_with_sample_weight":
        as_tensor = lambda t: None if t is None else keras.ops.convert_to_tensor(t, dtype)
        weights = keras_loss.apply_mask(as_tensor(sample_weight), as_tensor(mask), dtype=values.dtype,
                                        reduction=reduction)
        if weights is None:
            return None
        _, weights = keras_loss.squeeze_or_expand_to_same_rank(values, tf.cast(weights, values.dtype))
        return tf.reduce_sum(tf.cast(weights, tf.float64))  # Keras divides by the summed weights
    return None  # no reduction


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
