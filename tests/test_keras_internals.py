"""The private Keras/TensorFlow attributes tarantella's step relies on still exist and mean
what it assumes. When a Keras release changes one, this file fails first, naming it."""

import importlib.util

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import run_python
from tarantella import backends
from tarantella.backends import loss_terms
from tarantella.backends.tensorflow import traced_step
from tarantella.backends.tensorflow.step import TensorFlowStep


def test_a_loss_hands_its_output_mask_and_ignored_classes_to_the_reduction_tarantella_replaces():
    tokens = keras.Input((4,), dtype="int32")
    output = keras.layers.Dense(3)(keras.layers.Embedding(5, 3, mask_zero=True)(tokens))
    y_pred = keras.Model(tokens, output)(np.array([[1, 2, 3, 0]]))
    masks = []
    original = loss_terms.keras_loss.reduce_weighted_values

    def watched(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
        masks.append(mask)
        return original(values, sample_weight, mask, reduction, dtype)

    loss_terms.keras_loss.reduce_weighted_values = watched
    try:
        keras.losses.SparseCategoricalCrossentropy(ignore_class=0)(np.array([[1, 0, 2, 2]]), y_pred)
    finally:
        loss_terms.keras_loss.reduce_weighted_values = original
    assert len(masks) == 1, "Loss.__call__ no longer calls keras.src.losses.loss.reduce_weighted_values"
    # The output's mask (token 0 at the end) and the ignored class (target 0) combined.
    np.testing.assert_array_equal(masks[0], [[True, False, True, False]])


def test_compiled_losses_are_a_list_of_named_tuples_with_a_replaceable_loss():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.MeanSquaredError(reduction="sum"))
    model._symbolic_build(data_batch=(tf.TensorSpec((None, 3)), tf.TensorSpec((None, 2))))
    terms = model._compile_loss._flat_losses
    assert model._compile_loss.built and isinstance(terms, list) and len(terms) == 1
    assert terms[0].loss.reduction == "sum"
    assert terms[0]._replace(loss="replaced").loss == "replaced"


def test_tracing_a_step_builds_compiled_metrics_and_losses_and_changes_no_value():
    # tnt.Model builds the compiled state of a model without call() by tracing its step (model.py).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("adam", "mse", metrics=["mae"])
    weights = model.get_weights()
    assert model._compile_metrics.built is False and model._compile_loss.built is False
    tf.function(model.train_step).get_concrete_function((tf.TensorSpec((None, 3)), tf.TensorSpec((None, 2))))
    assert model._compile_metrics.built and model._compile_loss.built and model.optimizer.built
    metric_state = [v for metric in model.metrics for v in metric.variables]
    assert metric_state and not any(np.any(v.numpy()) for v in metric_state)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))


def test_an_optimizer_knows_the_variables_it_was_built_for():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    assert [id(v) for v in optimizer._trainable_variables] == [id(v) for v in model.trainable_variables]


def test_keras_messages_can_be_routed_away_from_stdout():
    assert keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        assert not keras.config.is_interactive_logging_enabled()
    finally:
        keras.config.enable_interactive_logging()


def test_synchronized_batch_normalization_computes_its_moments_in_the_function_tarantella_replaces():
    calls = []
    original = traced_step.keras_tensorflow_nn._compute_moments_sync

    def watched(x, axes, keepdims):
        calls.append(axes)
        return original(x, axes, keepdims)

    traced_step.keras_tensorflow_nn._compute_moments_sync = watched
    try:
        layer = keras.layers.BatchNormalization(synchronized=True)
        layer(np.ones((4, 3), np.float32), training=True)
    finally:
        traced_step.keras_tensorflow_nn._compute_moments_sync = original
    assert calls, "BatchNormalization(synchronized=True) no longer calls _compute_moments_sync"


def test_keras_fit_creates_as_many_iterators_before_each_epoch_as_tarantella_skips_when_resuming(monkeypatch):
    created = []
    real_iter = tf.data.Dataset.__iter__
    monkeypatch.setattr(tf.data.Dataset, "__iter__", lambda dataset: created.append(1) or real_iter(dataset))

    class CountAtEpochBegin(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.counts.append(len(created))

    samples = tf.data.Dataset.from_tensor_slices((np.zeros((6, 2), np.float32), np.zeros(6, np.float32)))
    for batches_known, dataset in ((True, samples.batch(2)), (False, samples.filter(lambda x, y: True).batch(2))):
        assert (int(dataset.cardinality()) >= 0) == batches_known
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        counter = CountAtEpochBegin()
        counter.counts = []
        created.clear()
        model.fit(dataset, epochs=4, verbose=0, callbacks=[counter])
        assert counter.counts == [epoch * backends.step_class().keras_iterators_per_epoch(batches_known) for epoch in range(4)]


def test_keras_own_train_step_differentiates_what_optimizer_scale_loss_returns():
    """tarantella weights the rank's share into `optimizer.scale_loss` under Keras' own train_step
    instead of weighting every gradient: Keras must take the gradients of exactly that value."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    calls = []
    model.optimizer.__dict__["scale_loss"] = lambda loss: calls.append(loss) or loss * 0.0
    model.fit(np.ones((4, 2), np.float32), np.full((4, 1), 3.0, np.float32), batch_size=4, verbose=0)
    assert calls, "Keras' train_step no longer calls optimizer.scale_loss"
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(new, old, err_msg="the gradients did not come from scale_loss's value")
    assert type(model).train_step is keras.Model.train_step  # how TensorFlowStep recognises Keras' own step


# tarantella/backends/jax/step.py and tarantella/backends/torch/step.py replace `moments` of Keras' JAX and torch
# backends during a training step. Each backend runs in its own process (KERAS_BACKEND is read once).
_MOMENTS_ON_BACKEND = """
import inspect, os, sys
import numpy as np
import keras
from keras.src.backend import {backend} as backend_module
nn = backend_module.nn
parameters = list(inspect.signature(nn.moments).parameters)
assert parameters == ["x", "axes", "keepdims", "synchronized"], parameters
# The layer refuses synchronized=True when built on this backend: tnt.Model sets the attribute.
try:
    keras.layers.BatchNormalization(synchronized=True)
except ValueError:
    pass
else:
    sys.exit("BatchNormalization(synchronized=True) is accepted on {backend} now: tarantella's docs say it is not")
calls = []
original = nn.moments
def watched(x, axes, keepdims=False, synchronized=False):
    calls.append((tuple(x.shape), list(axes), keepdims, synchronized))
    return original(x, axes, keepdims=keepdims)
nn.moments = watched
try:
    layer = keras.layers.BatchNormalization()
    layer.synchronized = True
    layer(np.ones((4, 2, 2, 3), np.float32), training=True)
    layer(np.ones((4, 2, 2, 3), np.float32), training=False)
finally:
    nn.moments = original
assert calls == [((4, 2, 2, 3), [0, 1, 2], False, True)], calls
# Keras' own moments still refuses synchronized=True, which tarantella's replacement provides.
try:
    original(keras.ops.ones((4, 3)), [0], synchronized=True)
except NotImplementedError:
    pass
else:
    sys.exit("Keras' {backend} moments computes synchronized moments itself now")
print("checked")
"""


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_synchronized_batch_normalization_calls_the_backend_moments_tarantella_replaces(backend, tmp_path):
    """BatchNormalization with `synchronized = True` set after construction (as tnt.Model does) calls
    keras.src.backend.<backend>.nn.moments(x, axes, keepdims=False, synchronized=True), looked up at
    call time, and only while training."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    script = tmp_path / "moments.py"
    script.write_text(_MOMENTS_ON_BACKEND.format(backend=backend))
    process = run_python(script, env={"KERAS_BACKEND": backend}, timeout=300)
    assert process.returncode == 0 and "checked" in process.stdout, process.stdout[-2000:] + process.stderr[-3000:]


# tarantella/backends/batch_draws.py replaces the shaped draws of keras.src.backend.<backend>.random on JAX
# and torch: tests/workers/serial_draws.py (run by test_jax_backend.py and test_torch_backend.py) checks first
# that keras.random still calls them, and that JAX's draws depend on their position alone.


# tarantella/data/keras_batches.py hands arrays, PyDatasets and DataLoaders to Keras' own adapters and
# relies on how Keras' trainers drive them; each backend runs in its own process.
_KERAS_BATCHES_ON_BACKEND = """
import random
import numpy as np
import keras
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing

backend = keras.backend.backend()
# Which inputs Keras slices as arrays.
assert array_data_adapter.can_convert_arrays((np.ones((4, 2)), np.ones(4), None))
assert not array_data_adapter.can_convert_arrays((iter([1, 2]), None, None))
# validation_split: the last part of the samples, before any shuffle.
(x, y, w), (vx, vy, vw) = array_slicing.train_validation_split((np.arange(10), np.arange(10), None), 0.2)
assert list(vx) == [8, 9] and list(x) == list(range(8)) and w is None and vw is None
adapter = array_data_adapter.ArrayDataAdapter(np.arange(10.0), np.arange(10), batch_size=4, class_weight={0: 2.0})
assert adapter._num_samples == 10 and adapter.batch_size == 4 and len(adapter._inputs) == 3

builds = []
class Recorded(keras.Sequential):
    def _symbolic_build(self, iterator=None, data_batch=None):
        builds.append(type(iterator).__name__)
        return super()._symbolic_build(iterator=iterator, data_batch=data_batch)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        builds.append(type(iterator).__name__)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

epochs_seen = []
class Epochs(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        epochs_seen.append(epoch)

model = Recorded([keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(np.ones((6, 2), "float32"), np.ones(6, "float32"), batch_size=2, epochs=2, verbose=0, callbacks=[Epochs()])
model.evaluate(np.ones((6, 2), "float32"), np.ones(6, "float32"), batch_size=2, verbose=0)
# fit's build hook, then evaluate's, each given the epoch iterator over the arrays
assert len(builds) == 2 and all(name.endswith("EpochIterator") for name in builds), builds

# What replay_passes reads of an epoch iterator, and Keras' iterator per epoch plus the next one.
from keras.src.trainers.epoch_iterator import EpochIterator
made = []
class Counting(EpochIterator):
    def _get_iterator(self):
        made.append(1)
        return super()._get_iterator()
iterator = Counting(x=np.ones((6, 2)), batch_size=2)
assert iterator.num_batches == 3 and hasattr(iterator.data_adapter, "on_epoch_begin")
for _ in range(2):
    for _ in iterator:
        pass
assert len(made) == 2 * 2, made  # each epoch's iterator and the one made for the next epoch

# How the trainers' _symbolic_build builds a model from symbolic inputs, which model/inputs.py calls
# before predict: it builds a Sequential model without an Input too.
from keras.src import backend as keras_backend
unbuilt = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2)])
output = keras_backend.compute_output_spec(unbuilt, keras.KerasTensor((None, 4, 3), "float32"), training=False)
assert unbuilt.built and tuple(output.shape) == (None, 2) and tuple(unbuilt.layers[1].kernel.shape) == (12, 2)
print("checked")
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_builds_from_its_own_epoch_iterator_over_the_inputs_it_batches(backend, tmp_path):
    """keras_batches.py hands arrays, PyDatasets and DataLoaders to Keras' adapters: it needs Keras'
    test of array inputs, its validation split and array adapter, the build hook each backend's
    fit and evaluate call with their epoch iterator (_symbolic_build on JAX and torch,
    _maybe_symbolic_build on TensorFlow), the epoch iterator's parts it replays, and the function
    that _symbolic_build builds a model with, which tnt.Model calls before predict."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    script = tmp_path / "keras_batches.py"
    script.write_text(_KERAS_BATCHES_ON_BACKEND)
    process = run_python(script, env={"KERAS_BACKEND": backend}, timeout=300)
    assert process.returncode == 0 and "checked" in process.stdout, process.stdout[-2000:] + process.stderr[-3000:]


def test_tensorflow_tells_whether_a_global_seed_is_set():
    """keras_batches.needs_own_shuffle: without a global seed, Keras' tf.random.shuffle draws a
    different order in every process."""
    tf.random.set_seed(None)
    assert tf.compat.v1.get_seed(None)[0] is None
    keras.utils.set_random_seed(3)
    try:
        assert tf.compat.v1.get_seed(None)[0] == 3
    finally:
        tf.random.set_seed(None)


def test_a_held_tensorflow_read_is_not_changed_by_later_updates():
    """TensorFlow's step snapshots variables for a backup by holding a read of each, without
    copying: a later assignment or optimizer update must write into a new buffer, not into the
    one that is held and that the backup's thread reads in place."""
    variable = keras.Variable(np.arange(6, dtype="float32").reshape(2, 3))
    optimizer = keras.optimizers.SGD(0.5, momentum=0.9)
    optimizer.build([variable])
    held, = TensorFlowStep.snapshot([variable])
    in_place = np.asarray(held)
    before = in_place.copy()
    assert np.shares_memory(in_place, np.asarray(held))  # NumPy reads the held tensor in place
    variable.assign_add(np.ones((2, 3), "float32"))
    optimizer.apply([tf.ones((2, 3))], [variable])
    tf.function(lambda: optimizer.apply([tf.ones((2, 3))], [variable]))()  # as in the traced step
    variable.assign(np.zeros((2, 3), "float32"))
    np.testing.assert_array_equal(in_place, before)
    np.testing.assert_array_equal(np.asarray(held), before)
    assert not np.array_equal(variable.numpy(), before)


def test_an_accumulating_optimizer_adds_unscaled_gradients_and_applies_their_mean_as_accumulation_assumes():
    """backends/accumulation.py: Keras' optimizer decides an update step by (iterations + 1) % k, keeps
    one accumulator per variable (`_accumulated_gradients[_get_variable_index(v)]`) of gradients
    divided by `loss_scale_factor`, and on the update step applies (gradient + accumulator) / k."""
    from tarantella.backends import accumulation
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2, loss_scale_factor=4.0)
    optimizer.build([variable])
    assert accumulation.steps(optimizer) == 2
    assert not accumulation.is_update_step(int(optimizer._iterations.numpy()), 2)
    optimizer.apply([np.array([4.0, 8.0], "float32")], [variable])
    [accumulator] = accumulation.accumulators(optimizer, [variable])
    np.testing.assert_array_equal(accumulator.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(variable.numpy(), [0.0, 0.0])
    assert accumulation.is_update_step(int(optimizer._iterations.numpy()), 2)
    # What a rank sends on the update step: its gradient and its accumulator in the gradients' scale.
    sent = np.array([4.0, 4.0], "float32") + np.asarray(accumulation.in_gradient_scale(accumulator.numpy(), optimizer))
    accumulator.assign(np.zeros(2, "float32"))
    optimizer.apply([sent], [variable])
    np.testing.assert_allclose(variable.numpy(), [-1.0, -1.5])  # serially: -([4, 8] / 4 + [4, 4] / 4) / 2
    np.testing.assert_array_equal(accumulator.numpy(), [0.0, 0.0])


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_copy_of_a_checkpoint_callback_counts_the_batches_it_saves_at_as_the_callback_does(tmp_path,
                                                                                            steps_per_execution):
    """callbacks._BatchSaves runs Keras' `_should_save_on_batch` on a copy of a ModelCheckpoint or
    BackupAndRestore (and resets BackupAndRestore's `_last_batch_seen` at an epoch's end, as it
    does), so that every rank knows where the master's callback saves. Two fits of 2 epochs of 7
    batches: the copies must name the very batches the callbacks saved at."""
    from tarantella import callbacks

    saved = []

    class Checkpoint(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            if batch is not None:
                saved.append(("checkpoint", epoch, batch))

    class Backup(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            saved.append(("backup", self._current_epoch, self._last_batch_seen))

    savers = [Checkpoint(str(tmp_path / "c.keras"), save_freq=4), Backup(str(tmp_path / "b"), save_freq=5)]
    predicted = []

    class Predicting(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.copies = [callbacks._BatchSaves.of(saver) for saver in savers]

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            for name, copy in zip(("checkpoint", "backup"), self.copies):
                if copy.at(batch):
                    predicted.append((name, self.epoch, batch))

        def on_epoch_end(self, epoch, logs=None):
            for copy in self.copies:
                copy.epoch_ended()

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x, y = np.zeros((14, 2), "float32"), np.zeros((14, 1), "float32")
    for _ in range(2):
        model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[Predicting(), *savers])
    actual = [(name, epoch if name == "checkpoint" else None, batch if name == "checkpoint" else None)
              for name, epoch, batch in saved]
    expected = [(name, epoch if name == "checkpoint" else None, batch if name == "checkpoint" else None)
                for name, epoch, batch in predicted]
    assert len(saved) >= 6 and expected == actual, (predicted, saved)
