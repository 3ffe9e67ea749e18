"""A user's own `train_step`/`test_step` on the JAX and torch backends: which of its metric state is
fed one number per step, which values it returns are metric results, and its logs made global.

The step runs on the rank's micro-batch with every metric variable at zero, so afterwards the metric
state holds the rank's increments. Summed over the ranks and added to the state before the step,
they give the serial state, except where a `Mean` or `Sum` was fed one scalar per step without a
weight (a loss tracker given the batch's mean loss): there each rank's increment is weighted by its
share m/B of the global batch, so that the sum is the serial step's one number (TensorFlow's
traced_step.py does the same). A log value the step read from a metric (`result`,
`stateless_result`) is read again from the global state; any other number becomes its share-weighted
sum over the ranks, the global mean of a per-batch value.
"""

import contextlib

import keras
import numpy as np


class WatchedMetrics:
    """Watches `metrics` (the model's `metrics`) while a user's step runs.

    Args:
        metrics: the metrics whose state the step receives, in `model.metrics` order.
        variables: `model.metrics_variables`, the state's order.
    """

    def __init__(self, metrics, variables):
        self.metrics = metrics
        self._position = {id(v): i for i, v in enumerate(variables)}
        self._count = len(variables)
        self._per_batch = set()  # positions of variables fed one scalar per step
        self._results = {}  # id(returned value) -> (metric, key in its dict result, or None)
        self._kept = []  # the values recorded, so that their ids stay theirs while the step runs

    def positions(self, metric):
        """Where `metric`'s variables lie in the state."""
        return [self._position[id(v)] for v in metric.variables]

    def weights(self, share):
        """Per state variable: `share` where the step fed it one scalar per step, else None."""
        return [share if i in self._per_batch else None for i in range(self._count)]

    @contextlib.contextmanager
    def installed(self):
        with contextlib.ExitStack() as stack:
            for metric in self.metrics:
                for name in ("update_state", "stateless_update_state"):
                    stack.enter_context(instance_override(metric, name, self._watch_update(metric, name)))
                for name in ("result", "stateless_result"):
                    stack.enter_context(instance_override(metric, name, self._watch_result(metric, name)))
            yield

    def _watch_update(self, metric, name):
        original = getattr(metric, name)
        stateless = name == "stateless_update_state"
        per_batch_kind = isinstance(metric, (keras.metrics.Mean, keras.metrics.Sum))

        def update(*args, **kwargs):
            rest = args[1:] if stateless else args
            values = rest[0] if rest else kwargs.get("values")
            weight = rest[1] if len(rest) > 1 else kwargs.get("sample_weight")
            if per_batch_kind and weight is None and values is not None and np.ndim(values) == 0:
                self._per_batch.update(self.positions(metric))
            return original(*args, **kwargs)

        return update

    def _watch_result(self, metric, name):
        original = getattr(metric, name)

        def result(*args, **kwargs):
            value = original(*args, **kwargs)
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for key, leaf in items:
                self._results[id(leaf)] = (metric, key)
                self._kept.append(leaf)
            return value

        return result

    def split_logs(self, logs):
        """The leaves of `logs` and, by leaf index, the numbers among them that no metric gave."""
        leaves = keras.tree.flatten(logs)
        numbers = {i: leaf for i, leaf in enumerate(leaves)
                   if id(leaf) not in self._results and _is_float_array(leaf)}
        return leaves, numbers

    def global_logs(self, logs, leaves, combined_numbers, result_of):
        """`logs` with metric results read again (`result_of(metric)`: the metric's result from the
        global state) and the other numbers replaced by `combined_numbers` (by leaf index)."""
        fresh, out = {}, []
        for index, leaf in enumerate(leaves):
            if id(leaf) in self._results:
                metric, key = self._results[id(leaf)]
                if id(metric) not in fresh:
                    fresh[id(metric)] = result_of(metric)
                out.append(fresh[id(metric)] if key is None else fresh[id(metric)][key])
            else:
                out.append(combined_numbers.get(index, leaf))
        return keras.tree.pack_sequence_as(logs, out)


def model_optimizers(model):
    """Every optimizer `model` holds: `optimizer` and any other attribute (a GAN's `d_optimizer`,
    ...); an optimizer wrapped by another (LossScaleOptimizer) counts once."""
    found = {}
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, keras.optimizers.Optimizer):
            found[id(value)] = value
    inner = {id(getattr(o, "inner_optimizer", None)) for o in found.values()}
    return [o for key, o in found.items() if key not in inner]


@contextlib.contextmanager
def refused_synchronized_moments(module, backend_name):
    """While a custom step on JAX or torch runs: `module.moments` (Keras' backend's, which
    BatchNormalization calls) refuses synchronized=True on every rank, before any of its collectives
    (every rank runs the same step)."""
    original = module.moments

    def moments(x, axes, keepdims=False, synchronized=False):
        if synchronized:
            raise NotImplementedError(
                f"Synchronized BatchNormalization inside an overridden train_step or test_step is not supported "
                f"on Keras' {backend_name} backend yet. Use Keras' built-in step (override compute_loss "
                "instead), leave the layers unsynchronized, or use the TensorFlow backend.")
        return original(x, axes, keepdims=keepdims)

    module.moments = moments
    try:
        yield
    finally:
        module.moments = original


@contextlib.contextmanager
def instance_override(obj, name, replacement):
    """Replaces a method on one object while a step runs (Keras objects track attributes they are
    given, so the instance dictionary is used directly)."""
    had, before = name in obj.__dict__, obj.__dict__.get(name)
    obj.__dict__[name] = replacement
    try:
        yield
    finally:
        if had:
            obj.__dict__[name] = before
        else:
            obj.__dict__.pop(name, None)


def _is_float_array(value):
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return False
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))
