"""How tnt.Model feeds its steps: the user's inputs split into each rank's micro-batches or handed to
Keras' own adapters, the wrapped model built for a distributed step where Keras would build it,
and the master's weights and statistics given to every rank before the first step."""

import contextlib
import logging

import keras
import tensorflow as tf
# How Keras' trainers build a model from symbolic inputs; tests/test_keras_internals.py checks it.
from keras.src import backend as keras_backend

from tarantella.backends import accumulation
from tarantella.data import global_batches, keras_batches, pipelines
from tarantella.model import checks

logger = logging.getLogger("tarantella")

# Below this many samples per rank, per-rank BatchNormalization statistics get noisy.
_SMALL_BATCH_NORMALIZATION_BATCH = 16


class Inputs:
    """The part of tnt.Model that turns inputs into steps (a mixin of `Model`)."""

    def _symbolic_build(self, iterator=None, data_batch=None):
        """Keras-on-JAX's and on-torch's fit and evaluate call this with their epoch iterator before
        the first step (tests/test_keras_internals.py checks it): where Keras batches the input, the
        wrapped model is built from one batch of that iterator exactly when serial Keras would build
        it so (the pass it draws is part of serial Keras' sequence of orders)."""
        kind = self._sources.next_build()
        if iterator is not None and self._sources.by_keras[kind]:
            keras_batches.build_as_keras_does(self._keras_model, iterator)
            self.built = True  # the wrapper has no variables of its own: Keras must not build it again
            self._prepare_keras_batched(kind, iterator, element_spec=None)
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras-on-TensorFlow's fit and evaluate call this with their epoch iterator; TensorFlow
        builds the wrapped model from the spec of Keras' dataset, which reads no batch."""
        kind = self._sources.next_build()
        if iterator is not None and self._sources.by_keras[kind]:
            self._prepare_keras_batched(kind, iterator, iterator.data_adapter.get_tf_dataset().element_spec)
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _prepare_keras_batched(self, kind, iterator, element_spec):
        if kind == "train" and self._epoch_order is not None:
            self._epoch_order.replay_through(iterator)
        if self._distributed:
            self._prepare(element_spec, kind)

    def _rows_of_batch(self, x, y, sample_weight, step):
        """The rank's rows of the global batch that train_on_batch, test_on_batch or
        predict_on_batch (`step`) was given: its step receives them cut already, even where an
        earlier fit, evaluate or predict on arrays left the step cutting its rows itself."""
        self._sources.record(step, by_keras=False, distributed_by_tarantella=False, model=self)
        if not self._distributed:
            return x, y, sample_weight
        batch = tf.nest.map_structure(
            lambda a: None if a is None else tf.convert_to_tensor(a),
            keras.utils.pack_x_y_sample_weight(*(tuple(a) if isinstance(a, list) else a for a in (x, y, sample_weight))))
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None] + t.shape[1:], t.dtype), batch)
        self._prepare(spec, step)
        rank, size = self._comm.rank, self._comm.size
        rows = tf.nest.map_structure(lambda t: pipelines.rows_of_rank(t, rank, size), batch)
        if self._step.keras_steps_take_arrays:
            rows = tf.nest.map_structure(lambda t: t.numpy(), rows)
        return keras.utils.unpack_x_y_sample_weight(rows)

    def _split(self, method, dataset, distribute):
        """The rank's part of a dataset of global batches: its micro-batches, or the dataset itself
        where each rank passes its own shard."""
        if not distribute:
            logger.info("%s: automatic data distribution is off; each rank uses the dataset it passed.", method)
            return dataset
        return pipelines.distribute(dataset, self._comm.rank, self._comm.size)

    def _validation_input(self, validation_data, batch_size, micro_batch_size, distribute):
        """fit's validation data as Keras takes it, whether Keras batches it, and the spec of its
        global batches where TensorFlow cannot tell their number (else None): as given for inputs
        Keras batches itself, else the rank's part of the dataset."""
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
        if keras_batches.is_batched_by_keras(val_x, val_y, val_weight):
            return validation_data, True, None
        method = "fit (validation_data)"
        if not isinstance(val_x, tf.data.Dataset):
            keras_batches.refuse_unknown_input(method, val_x)
        global_batches.refuse_separate_arrays(method, val_y, val_weight, batch_size)
        ranks = self._comm.size if distribute else 1
        dataset = global_batches.global_batches(method, val_x, micro_batch_size, ranks)
        return self._split(method, dataset, distribute), False, unknown_length_spec(dataset) if distribute else None

    def _global_batch_of(self, x, batch_size, by_keras, distributed_by_us):
        """The global batch size of fit's steps, or None where it is not known in advance. A dataset
        tarantella split still shows the global batch; a shard the user made holds the micro-batch."""
        if not by_keras:
            batch = pipelines.global_batch_size(x)
        elif isinstance(x, keras.utils.PyDataset) or keras_batches.is_torch_data_loader(x):
            batch = None
        else:
            batch = batch_size or 32  # Keras' default for arrays
        return batch if distributed_by_us or batch is None else batch * self._comm.size

    def _check_same_step_counts(self, count, steps, purpose):
        """With data the user sharded, a rank with fewer batches would leave the others waiting."""
        if not self._distributed or steps is not None:
            return
        counts = self._comm.allgather(count, f"the count of {purpose} batches per rank")
        if len(set(counts)) > 1:
            listing = ", ".join(f"rank {rank}: {count if count >= 0 else 'endless'}"
                                for rank, count in enumerate(counts))
            raise ValueError(
                f"With automatic distribution off, the ranks' {purpose} datasets hold different numbers of "
                f"batches ({listing}). Every rank must run the same number of steps: give each rank the "
                "same number of batches (e.g. shard, then take()), or pass the steps argument.")

    def _draw_build_pass(self, dataset):
        """Keras-on-JAX's and on-torch's fit and evaluate build an unbuilt model, or its compiled loss
        and metrics, from the first batch of one extra pass over the dataset, and that pass draws a
        shuffle order of its own. So the pass is drawn here and the wrapped model built from the
        dataset's spec, its unknown dimensions those of that batch: the epochs then see serial Keras'
        orders. The pass reads its first batch, as Keras' does: some pipelines draw their seeds only
        then (a shuffled `list_files` under a parallel interleave), and an iterator that reads
        nothing would leave every later epoch one order behind serial Keras'."""
        if not self._step.keras_builds_from_an_extra_pass or not keras_batches.needs_build(self._keras_model):
            return
        first_batch = next(iter(dataset), None)
        self._keras_model._symbolic_build(data_batch=_spec_with_dimensions_of(dataset.element_spec, first_batch))

    def _spec_to_build_from(self, dataset):
        """The dataset's spec, with the dimensions it leaves unknown read from its first batch."""
        if not _has_unknown_dimensions(dataset.element_spec):
            return dataset.element_spec
        return _spec_with_dimensions_of(dataset.element_spec, next(iter(dataset), None))

    def _prepare(self, element_spec, step):
        """Builds every variable the coming `step` ("train", "test" or "predict") uses, then gives
        all ranks the master's values (once, or after a change)."""
        wrapped = self._keras_model
        compiled_state = step != "predict"
        if compiled_state and checks.overrides(wrapped, "train_step") and not checks.overrides(wrapped, "call"):
            # A GAN-like model has no forward pass of its own to build from: its sub-models
            # must come built, or each rank would create their weights with its own values.
            unbuilt = [layer.name for layer in wrapped._flatten_layers(include_self=False) if not layer.built]
            if unbuilt:
                raise ValueError(
                    f"Layers {unbuilt[:5]} of {wrapped.name} have no weights yet, so they would be created "
                    "with different random values on each rank. Build them before fit (give each sub-model "
                    "a keras.Input, or call it once on a batch).")
            _build_compiled_metrics_and_losses(wrapped, element_spec, step)
        elif compiled_state:
            with _left_unbuilt(self._step.optimizers()):
                wrapped._symbolic_build(data_batch=element_spec)
        elif not all(layer.built for layer in wrapped._flatten_layers()):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(element_spec)
            symbolic = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), x)
            # Called as Keras' trainers build (`_symbolic_build`): the model's compute_output_spec would
            # not build a Sequential model without an Input.
            keras_backend.compute_output_spec(wrapped, symbolic, training=False)
        self.built = True
        if self._weights_synced:
            return
        variables = list(self.weights)
        for optimizer in self._step.optimizers():
            if optimizer.built:
                variables += list(optimizer.variables)
        checks.check_same_compile_settings(self._comm, self, self.gradient_wire)
        checks.check_same_variables_everywhere(self._comm, variables)
        checks.broadcast_from_master(self._comm, variables, "the broadcast of the master's weights")
        accumulation.count_on_master_only(self._comm, self._step.locally_accumulating_optimizers())
        self._weights_synced = True

    def _use_masters_statistics(self):
        """Non-trainable state (e.g. BatchNormalization's moving statistics) is gathered per
        micro-batch; whenever the model is evaluated, and after training, every rank uses the
        master's. The master always has samples: row 0 of every global batch is its own."""
        if self._distributed and self.non_trainable_weights:
            checks.broadcast_from_master(self._comm, self.non_trainable_weights,
                                   "the broadcast of the master's non-trainable weights")

    def _warn_small_batch_normalization_batches(self, global_batch):
        if self._warned_batch_normalization:
            return
        # A frozen layer (trainable=False) runs in inference mode in Keras 3: no batch statistics.
        has_batch_normalization = any(isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
                                      and not layer.synchronized for layer in self._flatten_layers())
        if has_batch_normalization and global_batch is not None and \
                global_batch // self._comm.size < _SMALL_BATCH_NORMALIZATION_BATCH:
            logger.warning(
                "The model has BatchNormalization layers and micro-batches of %d samples (global batch "
                "%d over %d ranks). Each rank normalizes with the statistics of its own micro-batch, "
                "not of the global batch, so training differs from serial training and is noisy below "
                "%d samples per rank. Use tnt.Model(model, synchronized_batch_normalization=True) to "
                "normalize with the global batch's statistics (serial results), or a larger global batch.",
                global_batch // self._comm.size, global_batch, self._comm.size,
                _SMALL_BATCH_NORMALIZATION_BATCH)
            self._warned_batch_normalization = True


class BatchSources:
    """Per kind of step ("train", "test", "predict"): whether Keras' own adapter batches its input
    (arrays, a PyDataset, a DataLoader: keras_batches.py) and, if so, whether the step receives
    every global batch whole and keeps the rank's rows (tarantella distributes it on 2+ ranks)."""

    FUNCTIONS = {"train": "train_function", "test": "test_function", "predict": "predict_function"}

    def __init__(self):
        self.by_keras = dict.fromkeys(self.FUNCTIONS, False)
        self.keeps_rows = dict.fromkeys(self.FUNCTIONS, False)
        self.building = None  # "train" from fit's start until Keras builds for its training

    def record(self, kind, by_keras, distributed_by_tarantella, model):
        """Sets the coming `kind` of step's source; a step traced for the other one is traced anew."""
        self.by_keras[kind] = by_keras
        keeps_rows = by_keras and distributed_by_tarantella
        if keeps_rows != self.keeps_rows[kind]:
            self.keeps_rows[kind] = keeps_rows
            setattr(model, self.FUNCTIONS[kind], None)

    def next_build(self):
        """The kind of step Keras builds for now: fit's first build is for training, every later one
        (its validation, evaluate) for testing."""
        kind, self.building = self.building or "test", None
        return kind

    def rows_of_rank(self, kind, step_arguments, comm):
        """The step's arguments with its batch (the last one) cut to the rank's rows where the step
        receives global batches."""
        if not self.keeps_rows[kind]:
            return step_arguments
        *state, batch = step_arguments
        rows = tf.nest.map_structure(lambda leaf: pipelines.rows_of_rank(leaf, comm.rank, comm.size), batch)
        return (*state, rows)


@contextlib.contextmanager
def _left_unbuilt(optimizers):
    """Building the model for a distributed step builds no optimizer: Keras-on-TensorFlow builds it
    inside the first traced step, and the result can depend on it (ScheduleFreeAdamW's momentum,
    assigned in its `build`, is then assigned in every step). Where fit builds it first (on JAX and
    torch), it is built by then. A fresh optimizer's state is alike on every rank, as the weights it
    is built from are."""
    unbuilt = [optimizer for optimizer in optimizers if not optimizer.built]
    for optimizer in unbuilt:
        optimizer.built = True
    try:
        yield
    finally:
        for optimizer in unbuilt:
            optimizer.built = False


def _has_unknown_dimensions(element_spec):
    """Whether a dataset's spec leaves a dimension other than the batch's unknown (the windows of
    `timeseries_dataset_from_array`, padded sequences), or a tensor's rank."""
    return any(spec.shape.rank is None or None in spec.shape[1:]
               for spec in tf.nest.flatten(element_spec) if isinstance(spec, tf.TensorSpec))


def _spec_with_dimensions_of(element_spec, batch):
    """`element_spec` with the dimensions it leaves unknown, but the batch's, taken from `batch`,
    one of its elements (the spec as it is where that is None). Keras' trainers build from a batch
    they read, not from a spec: where a dimension is unknown, Keras-on-torch and on-JAX would fill
    in sizes of their own (83), which a model built for other sizes refuses."""
    if batch is None:
        return element_spec

    def known(spec, tensor):
        if not isinstance(spec, tf.TensorSpec) or not _has_unknown_dimensions(spec):
            return spec
        batch_dimension = spec.shape[0] if spec.shape.rank else None
        return tf.TensorSpec([batch_dimension, *tensor.shape[1:]], spec.dtype, spec.name)

    return tf.nest.map_structure(known, element_spec, batch)


def unknown_length_spec(dataset):
    """The spec of a dataset's global batches where TensorFlow cannot tell their number, else None."""
    return dataset.element_spec if int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY else None


def _build_compiled_metrics_and_losses(model, element_spec, step):
    """Keras builds compiled metrics and losses from the model's forward pass (`_symbolic_build`),
    which a model without call() (a GAN, keras-io's Distiller) does not have; its step builds them
    while Keras traces it, and a distributed step must know every metric variable before it runs.
    So the step is traced once here, never run: like serial Keras' first trace, the trace creates
    the metric and loss state it uses (zeros) and any optimizer state, and changes no value."""
    # Keras private attributes; tests/test_keras_internals.py checks them.
    unbuilt = [state for state in (model._compile_metrics, model._compile_loss)
               if state is not None and not state.built]
    if unbuilt:
        step_function = model.train_step if step == "train" else model.test_step
        tf.function(step_function).get_concrete_function(element_spec)
