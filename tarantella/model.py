"""tnt.Model: a keras.Model that trains data-parallel across all ranks.

A thin wrapper: it turns the user's input into each rank's micro-batches (tarantella/data/), runs
the wrapped model's own steps through the global step of Keras' backend (a `backends.base.Step`:
`TensorFlowStep`, `JaxStep` or `TorchStep`, which make the gradients, losses and metrics those
of the serial step), gives every rank the master's
weights before the first step, and saves through saving.py. Everything else a Keras user
reads answers as the wrapped model does. With one rank, every method is plain Keras.
"""

import contextlib
import copy
import enum
import logging

import keras
import numpy as np
import tensorflow as tf
# Keras' validation_split, for arrays tarantella shuffles itself; tests/test_keras_internals.py checks it.
from keras.src.trainers.data_adapters import array_slicing

from tarantella import agreement, backends, backups, saving, timeline
from tarantella import callbacks as callbacks_module
from tarantella.common import config
from tarantella.data import global_batches, keras_batches, pipelines
from tarantella.data.epoch_order import EpochOrder
from tarantella.runtime import world

logger = logging.getLogger("tarantella")

# Below this many samples per rank, per-rank BatchNormalization statistics get noisy.
_SMALL_BATCH_NORMALIZATION_BATCH = 16

# Public names that answer as the wrapped model's, although keras.Model defines them on the
# wrapper too. Names tarantella changes (fit, save, ...) or that Keras' loop writes on the
# model it runs (stop_training, history, ...) are the wrapper's own.
_READ_FROM_WRAPPED = frozenset({
    "metrics", "metrics_names", "losses", "loss", "compiled_loss", "compiled_metrics", "input_spec",
    "compute_output_shape", "compute_output_spec", "compute_mask", "count_params", "get_build_config",
    "layers", "input", "output", "inputs", "outputs", "input_shape", "output_shape", "get_layer",
    "to_json", "get_compile_config", "optimizer", "compute_loss", "compute_metrics",
    "get_metrics_result", "quantize", "dtype_policy", "dtype", "compute_dtype", "variable_dtype",
    "input_dtype", "supports_masking", "trainable_weights", "non_trainable_weights", "trainable_variables",
    "non_trainable_variables", "weights", "variables", "get_weights", "call_signature_parameters",
    "get_quantization_layer_structure", "quantized_build", "quantized_call", "rematerialized_call",
    "stateless_compute_loss", "load_own_variables", "save_own_variables",
})


class ParallelStrategy(enum.Enum):
    """How `tnt.Model` parallelizes training; data parallelism is the only strategy."""
    DATA = "data"


class Model(keras.Model):
    """Wraps a Keras model so that fit/evaluate/predict split every global batch across ranks.

    The wrapped model may override train_step, test_step, predict_step, compute_loss or
    compute_metrics, use several optimizers, and have its own compile signature. A tnt.Model
    answers as the model it wraps (layers, weights, its own attributes and methods).

    Args:
        model: the `keras.Model` to train (Functional, Sequential or subclassed); it is wrapped,
            not copied.
        parallel_strategy: `tnt.ParallelStrategy.DATA`, the only strategy.
        synchronized_batch_normalization: True switches every BatchNormalization layer of the
            model to Keras' `synchronized=True` when there are 2 or more ranks: each normalizes
            with the statistics of the whole global batch, so training equals serial training
            on any number of ranks. (On one rank the layers stay as they are.)

    Raises:
        TypeError: `model` is not a `keras.Model`, or is a tnt.Model already.
        NotImplementedError: the model overrides `train_step` or `test_step` on the JAX or
            PyTorch backend.
    """

    def __init__(self, model, parallel_strategy=ParallelStrategy.DATA, synchronized_batch_normalization=False):
        if isinstance(model, Model):
            raise TypeError("This model is already a tnt.Model; wrap the plain Keras model once.")
        if not isinstance(model, keras.Model):
            raise TypeError(f"tnt.Model wraps a keras.Model; got {type(model).__name__}.")
        if parallel_strategy is not ParallelStrategy.DATA:
            raise ValueError(f"Unknown parallel_strategy {parallel_strategy!r}; the only strategy is "
                             "tnt.ParallelStrategy.DATA.")
        if not isinstance(synchronized_batch_normalization, bool):
            raise TypeError(f"synchronized_batch_normalization must be True or False; got "
                            f"{synchronized_batch_normalization!r}.")
        _refuse_what_the_backend_lacks(backends.step_class(), model)
        super().__init__(name=model.name)
        self._keras_model = model
        # torch.nn.Module keeps sub-modules out of __dict__, where the lookups below read the model.
        self.__dict__["_keras_model"] = model
        self._comm = world.init()
        self._distributed = self._comm.size > 1
        if synchronized_batch_normalization and self._distributed:
            # On one rank the micro-batch is the global batch: Keras' own moments are the serial ones.
            for layer in model._flatten_layers():
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.synchronized = True
        self._weights_synced = False
        self._warned_batch_normalization = False
        self._local_epoch_logs = None
        self._sources = _BatchSources()
        self._epoch_order = None  # fit's, while it runs
        self._step = backends.for_model(self._comm, world.gradient_reducer(), model)
        # On TensorFlow a host-side allreduce cannot live inside an XLA cluster; JAX's jitted step
        # reaches it through callbacks.
        self._host_allreduce_outside_xla = self._distributed and not self._step.collectives_inside_xla
        if self._host_allreduce_outside_xla:
            self._jit_compile = False
        self.built = model.built

    # -- the wrapped model -------------------------------------------------------

    @property
    def model(self):
        """The wrapped Keras model, as in the original Tarantella."""
        return self._keras_model

    def __getattribute__(self, name):
        if name in _READ_FROM_WRAPPED:
            wrapped = object.__getattribute__(self, "__dict__").get("_keras_model")
            if wrapped is not None:
                return getattr(wrapped, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name):
        # Reached only when normal lookup fails: public attributes come from the wrapped model
        # (a GAN's generator, a custom model's own trackers and methods).
        wrapped = self.__dict__.get("_keras_model")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(wrapped, name)

    def build(self, input_shape=None):
        self.built = True  # the wrapped model builds itself on its first call

    def call(self, *args, **kwargs):
        return self._keras_model(*args, **kwargs)

    def get_config(self):
        return self._keras_model.get_config()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A new tnt.Model from `get_config()` (of a tnt.Model or a Keras model), or from a
        serialized model (`keras.saving.serialize_keras_object`); weights are new."""
        config = copy.deepcopy(config)  # Keras consumes the config while it rebuilds the model
        if "class_name" in config:
            keras_model = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
        elif "input_layers" in config:  # a functional model's get_config()
            keras_model = keras.Model.from_config(config, custom_objects=custom_objects)
        elif "layers" in config:
            keras_model = keras.Sequential.from_config(config, custom_objects=custom_objects)
        else:
            raise ValueError(
                "This config describes neither a functional nor a Sequential model, so its class is "
                "unknown. For a subclassed model, rebuild it with its own from_config and wrap it, or pass "
                "keras.saving.serialize_keras_object(model), which names the class.")
        return cls(keras_model)

    def summary(self, *args, **kwargs):
        """Keras' summary, printed on the master only (on every rank with TNT_OUTPUT_ON_ALL_DEVICES)."""
        if self._comm.rank == world.MASTER_RANK or config.output_on_all_devices():
            self._keras_model.summary(*args, **kwargs)

    def set_weights(self, weights):
        """Sets the weights; the master's values reach every rank before the next step."""
        self._keras_model.set_weights(weights)
        self._weights_synced = False  # the master's values go out before the next step

    # -- saving and loading (see saving.py) -------------------------------------------

    def save(self, filepath, overwrite=True, tnt_save_all_devices=False, **kwargs):
        """Saves the wrapped Keras model, with the optimizer state once compiled; the master writes,
        and every rank returns once the file is complete. `tnt_save_all_devices=True` makes every
        rank write, for file systems that the ranks do not share."""
        saving.write_whole(filepath, lambda partial: self._keras_model.save(partial, **kwargs),
                           overwrite, tnt_save_all_devices)

    def save_weights(self, filepath, overwrite=True, tnt_save_all_devices=False, max_shard_size=None):
        """Saves the weights (and the optimizer state once compiled); the master writes, and every
        rank returns once the file is complete. `tnt_save_all_devices=True` makes every rank write.

        Raises:
            ValueError: `max_shard_size` is given (sharded files cannot be written whole).
            FileExistsError: `overwrite=False` and the file exists.
        """
        if max_shard_size is not None:
            raise ValueError("tnt.Model.save_weights writes one file, which appears whole or not at all; "
                             "sharded saving (max_shard_size=) is not supported. Leave max_shard_size unset.")
        saving.write_whole(filepath, self._keras_model.save_weights, overwrite, tnt_save_all_devices)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Every rank reads the file (it must be visible to all); once compiled, the optimizer state too."""
        optimizer = getattr(self._keras_model, "optimizer", None)  # an uncompiled Keras model has none
        if self.compiled and self.built and optimizer is not None and not optimizer.built:
            optimizer.build(self.trainable_variables)  # else the saved optimizer state is skipped
        self._keras_model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self._weights_synced = False

    # -- compile, fit, evaluate, predict -----------------------------------------------

    def compile(self, *args, jit_compile="auto", **kwargs):
        """Compiles the wrapped model with the user's arguments (its own compile signature, if it
        has one); the wrapper shares its optimizer. Saved files are then complete Keras files."""
        if self._host_allreduce_outside_xla and jit_compile not in ("auto", False, None):
            logger.warning("jit_compile=True is ignored with %d ranks: XLA cannot compile the host-side "
                           "gradient allreduce, so the step runs without XLA.", self._comm.size)
        if self._host_allreduce_outside_xla:
            jit_compile = False  # Keras would pick XLA by itself on a GPU
        if _overrides(self._keras_model, "compile"):
            self._keras_model.compile(*args, **kwargs)
        else:
            self._keras_model.compile(*args, jit_compile=jit_compile, **kwargs)
        for optimizer in self._step.optimizers():
            _refuse_ftrl(optimizer)
        keras.Model.compile(self, optimizer=self._keras_model.optimizer, jit_compile=jit_compile,
                            run_eagerly=getattr(self._keras_model, "run_eagerly", False),
                            steps_per_execution=getattr(self._keras_model, "steps_per_execution", 1))
        self._weights_synced = False

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, tnt_micro_batch_size=None,
            tnt_validation_micro_batch_size=None, tnt_distribute_dataset=True,
            tnt_distribute_validation_dataset=True):
        """Keras' fit, with global batches: every rank trains on its rows of each batch.

        Takes Keras' arguments; `batch_size` and the batches of a dataset are global. Besides:

        Args:
            tnt_micro_batch_size: the batch per rank: an unbatched dataset is batched with
                micro-batch x ranks, and a batched one must hold that many samples per batch.
            tnt_validation_micro_batch_size: the same for `validation_data`.
            tnt_distribute_dataset: False: each rank passes its own part of the data, batched
                with its micro-batch size, and tarantella does not split it.
            tnt_distribute_validation_dataset: the same for `validation_data`.

        Returns:
            keras.callbacks.History: the global logs, equal on every rank.
        """
        self._check_compiled("fit")
        epoch_order = EpochOrder(initial_epoch)
        unknown_length = {"train": None, "test": None}
        ranks = self._comm.size if tnt_distribute_dataset else 1
        by_keras = keras_batches.is_batched_by_keras(x, y, sample_weight)
        if validation_split and not (by_keras and not isinstance(x, keras.utils.PyDataset)
                                     and not keras_batches.is_torch_data_loader(x)):
            raise ValueError("validation_split= needs array inputs; pass validation_data= (a dataset "
                             "batched with the global batch size) instead.")
        keras_arguments = {"shuffle": shuffle, "class_weight": class_weight}
        if by_keras and self._distributed and tnt_distribute_dataset and keras_batches.needs_own_shuffle(x, shuffle):
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                    (x, y, sample_weight), validation_split=validation_split)
            batch_size = keras_batches.keras_batch_size("fit", x, batch_size, tnt_micro_batch_size, ranks)
            validation_batch_size = validation_batch_size or batch_size
            x = pipelines.distribute(global_batches.seeded_shuffle_of_arrays(x, y, sample_weight, batch_size, shuffle, class_weight),
                                self._comm.rank, self._comm.size)
            y = sample_weight = None
            keras_arguments = {"shuffle": False}
            by_keras = False
            if steps_per_epoch is None:
                epoch_order.skip_earlier_passes_of(x)
        elif by_keras:
            batch_size = keras_batches.keras_batch_size("fit", x, batch_size, tnt_micro_batch_size, ranks)
            keras_arguments.update(y=y, sample_weight=sample_weight, batch_size=batch_size,
                                   validation_split=validation_split)
            if self._distributed and tnt_distribute_dataset:
                keras_batches.use_masters_random_state(self._comm)
        elif isinstance(x, tf.data.Dataset):
            global_batches.refuse_separate_arrays("fit", y, sample_weight, batch_size)
            users_dataset = x
            x = global_batches.global_batches("fit", x, tnt_micro_batch_size, ranks)
            if tnt_distribute_dataset and steps_per_epoch is None:
                unknown_length["train"] = _unknown_length_spec(x)
            x = self._split("fit", x, tnt_distribute_dataset)
            # Keras keeps one iterator across epochs with steps_per_epoch; a dataset an earlier fit
            # iterated goes on from its own passes, as in Keras.
            if steps_per_epoch is None and not getattr(users_dataset, "_tarantella_fitted", False):
                epoch_order.skip_earlier_passes_of(x)
            users_dataset._tarantella_fitted = True
            self._draw_build_pass(x)
        else:
            keras_batches.refuse_unknown_input("fit", x)
        validation_by_keras = bool(validation_split) and by_keras and validation_data is None
        if validation_data is not None:
            validation_data, validation_by_keras, unknown_length["test"] = self._validation_input(
                validation_data, validation_batch_size, tnt_validation_micro_batch_size,
                tnt_distribute_validation_dataset)
            if validation_steps is not None:  # Keras then never finds the data exhausted
                unknown_length["test"] = None
            if validation_by_keras and tnt_validation_micro_batch_size is not None:
                validation_batch_size = keras_batches.keras_batch_size(
                    "fit (validation_data)", validation_data[0], validation_batch_size,
                    tnt_validation_micro_batch_size, self._comm.size if tnt_distribute_validation_dataset else 1)
        self._sources.record("train", by_keras, self._distributed and tnt_distribute_dataset, self)
        self._sources.record("test", validation_by_keras, self._distributed and tnt_distribute_validation_dataset, self)
        global_batch = self._global_batch_of(x, keras_arguments.get("batch_size"), by_keras, tnt_distribute_dataset)
        if not tnt_distribute_dataset:
            count = (keras_batches.batch_count(x, y, sample_weight, keras_arguments.get("batch_size"), steps_per_epoch)
                     if by_keras else global_batches.count_batches(x))
            self._check_same_step_counts(count, steps_per_epoch, "training")
        if validation_data is not None and not validation_by_keras and not tnt_distribute_validation_dataset:
            self._check_same_step_counts(global_batches.count_batches(validation_data), validation_steps, "validation")
        if self._distributed:
            if not by_keras:  # inputs Keras batches are built from in _symbolic_build, as Keras does
                self._prepare(x.element_spec, "train")
            self._warn_small_batch_normalization_batches(global_batch)
            self._step.expect_global_batch_size(global_batch)
            for kind, spec in unknown_length.items():
                self._step.expect_unknown_length(kind, spec)
        automatic_backups = backups.for_fit(self, callbacks)
        # After the user's callbacks: an epoch's backup holds what they changed at its end.
        callbacks = self._callbacks_for_this_rank(callbacks) + [c for c in (automatic_backups, epoch_order) if c]
        self._epoch_order = epoch_order
        self._sources.building = "train"
        try:
            with self._keras_output_on_master_only():
                history = super().fit(
                    x, epochs=epochs, verbose=self._verbosity(verbose), callbacks=callbacks,
                    validation_data=validation_data, initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                    validation_batch_size=validation_batch_size, validation_freq=validation_freq,
                    **keras_arguments)
        finally:
            self._epoch_order = None
            self._sources.building = None
        if automatic_backups is not None:
            automatic_backups.complete_history(history)
        self._use_masters_statistics()
        if timeline.recorder is not None:
            timeline.recorder.write(self._comm, report=True)
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False, tnt_micro_batch_size=None, tnt_distribute_dataset=True,
                 **kwargs):
        """Keras' evaluate, with global batches; every rank returns the global loss and metrics.

        `tnt_micro_batch_size` and `tnt_distribute_dataset` work as in `fit`.
        """
        if kwargs.get("_use_cached_eval_dataset"):  # validation inside fit: already distributed
            self._use_masters_statistics()
            training_logs = self._local_metrics_result() if self._step.local_metric_state else None
            result = super().evaluate(x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight,
                                      steps=steps, callbacks=callbacks, return_dict=return_dict, **kwargs)
            if training_logs is not None:  # on_epoch_end comes after validation: keep both
                validation = {f"val_{name}": value for name, value in self._local_metrics_result().items()}
                self._local_epoch_logs = {**training_logs, **validation}
            return result
        self._check_compiled("evaluate")
        ranks = self._comm.size if tnt_distribute_dataset else 1
        by_keras = keras_batches.is_batched_by_keras(x, y, sample_weight)
        keras_arguments = {}
        if by_keras:
            batch_size = keras_batches.keras_batch_size("evaluate", x, batch_size, tnt_micro_batch_size, ranks)
            keras_arguments = {"y": y, "sample_weight": sample_weight, "batch_size": batch_size}
            if not tnt_distribute_dataset:
                self._check_same_step_counts(keras_batches.batch_count(x, y, sample_weight, batch_size, steps),
                                             steps, "evaluation")
        elif isinstance(x, tf.data.Dataset):
            global_batches.refuse_separate_arrays("evaluate", y, sample_weight, batch_size)
            x = global_batches.global_batches("evaluate", x, tnt_micro_batch_size, ranks)
            unknown_length = _unknown_length_spec(x) if tnt_distribute_dataset and steps is None else None
            x = self._split("evaluate", x, tnt_distribute_dataset)
            if not tnt_distribute_dataset:
                self._check_same_step_counts(global_batches.count_batches(x), steps, "evaluation")
            if self._distributed:
                self._prepare(x.element_spec, "test")
                self._step.expect_unknown_length("test", unknown_length)
        else:
            keras_batches.refuse_unknown_input("evaluate", x)
        self._sources.record("test", by_keras, self._distributed and tnt_distribute_dataset, self)
        self._use_masters_statistics()
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            return super().evaluate(x, verbose=self._verbosity(verbose), steps=steps, callbacks=callbacks,
                                    return_dict=return_dict, **keras_arguments, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None,
                tnt_micro_batch_size=None):
        """Keras' predict, with global batches: every rank gets every prediction, in the order
        of the input samples. `tnt_micro_batch_size` works as in `fit`."""
        if keras_batches.is_batched_by_keras(x):
            batch_size = keras_batches.keras_batch_size("predict", x, batch_size, tnt_micro_batch_size, self._comm.size)
            if self._distributed:
                unbuilt = not all(layer.built for layer in self._keras_model._flatten_layers())
                self._prepare(keras_batches.first_batch_spec(x, None, None) if unbuilt else None, "predict")
            self._sources.record("predict", True, self._distributed, self)
        elif isinstance(x, tf.data.Dataset):
            global_batches.refuse_separate_arrays("predict", None, None, batch_size)
            x = self._split("predict", global_batches.global_batches("predict", x, tnt_micro_batch_size, self._comm.size),
                            distribute=True)
            if self._distributed:
                self._prepare(x.element_spec, "predict")
            self._sources.record("predict", False, self._distributed, self)
        else:
            keras_batches.refuse_unknown_input("predict", x)
        self._use_masters_statistics()
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            return super().predict(x, batch_size=batch_size, verbose=self._verbosity(verbose), steps=steps,
                                   callbacks=callbacks)

    # -- Keras' build hooks: where Keras has made its iterator over inputs it batches itself ---------

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

    # -- the steps: the wrapped model's own, made global by the backend's Step ---------------

    def make_train_function(self, force=False):
        return self._made("train", force, super().make_train_function, "training step")

    def make_test_function(self, force=False):
        return self._made("test", force, super().make_test_function, "test step")

    def make_predict_function(self, force=False):
        return self._made("predict", force, super().make_predict_function, None)

    def _made(self, kind, force, make, timed_as):
        """Keras' `kind` of function, wrapped as the backend's step needs and, with a timeline, timed."""
        attribute = _BatchSources.FUNCTIONS[kind]
        new = getattr(self, attribute) is None or force
        make(force)
        if new and self._distributed:
            setattr(self, attribute, self._step.wrap_function(kind, getattr(self, attribute)))
        if new and timed_as and timeline.recorder is not None:
            setattr(self, attribute, timeline.recorder.timed_steps(getattr(self, attribute), timed_as))
        return getattr(self, attribute)

    # The arguments are the backend trainer's: (data) on TensorFlow and torch, (state, data) on JAX.
    def train_step(self, *step_arguments):
        if not self._distributed:
            return self._keras_model.train_step(*step_arguments)
        return self._step.train(*self._sources.rows_of_rank("train", step_arguments, self._comm))

    def test_step(self, *step_arguments):
        if not self._distributed:
            return self._keras_model.test_step(*step_arguments)
        return self._step.test(*self._sources.rows_of_rank("test", step_arguments, self._comm))

    def predict_step(self, *step_arguments):
        if not self._distributed:
            return self._keras_model.predict_step(*step_arguments)
        return self._step.predict(*self._sources.rows_of_rank("predict", step_arguments, self._comm))

    # -- one global batch, given whole to every rank ------------------------------------------

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Every rank passes the same global batch; each trains on its rows of it."""
        self._check_compiled("train_on_batch")
        x, y, sample_weight = self._rows_of_batch(x, y, sample_weight, "train")
        return super().train_on_batch(x, y, sample_weight=sample_weight, class_weight=class_weight,
                                      return_dict=return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        self._check_compiled("test_on_batch")
        x, y, sample_weight = self._rows_of_batch(x, y, sample_weight, "test")
        if self._distributed:
            self._use_masters_statistics()
        return super().test_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    def predict_on_batch(self, x):
        """Every rank gets the predictions of the whole batch."""
        x, _, _ = self._rows_of_batch(x, None, None, "predict")
        if self._distributed:
            self._use_masters_statistics()
        return super().predict_on_batch(x)

    def _rows_of_batch(self, x, y, sample_weight, step):
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

    # -- rank-local metric values (for callbacks with aggregate_logs=False) --------------------

    def _local_metrics_result(self):
        """This rank's own loss and metrics (its micro-batches only), in the form of Keras' logs."""
        pairs = self._step.local_metric_state or []
        with keras.StatelessScope(state_mapping=[(v, shadow.read_value()) for v, shadow in pairs]):
            result = self._keras_model.get_metrics_result()
        return {name: value.numpy().item() if np.ndim(value) == 0 else value.numpy()
                for name, value in result.items()}

    def _track_local_metrics(self, wanted):
        if wanted == (self._step.local_metric_state is not None):
            return
        self._step.local_metric_state = tuple(
            (v, tf.Variable(v.value, trainable=False)) for metric in self.metrics for v in metric.variables
        ) if wanted else None
        self.train_function = self.test_function = None  # retraced with or without the local copy

    def reset_metrics(self):
        super().reset_metrics()
        self._local_epoch_logs = None  # fit resets at each epoch; validation sets it after its reset
        for variable, shadow in self._step.local_metric_state or ():
            shadow.assign(variable.value)

    # -- helpers -------------------------------------------------------------------------

    def _check_compiled(self, method):
        if not self.compiled:
            raise RuntimeError(f"Call model.compile(optimizer, loss, metrics) before model.{method}().")

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
        return self._split(method, dataset, distribute), False, _unknown_length_spec(dataset) if distribute else None

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
        """Keras-on-JAX's and on-torch's fit build an unbuilt model, or its compiled loss and metrics, from the first
        batch of one extra pass over the dataset, and that pass draws a shuffle order of its own. So
        the pass is drawn here and the wrapped model built from the dataset's spec: the epochs then
        see serial Keras' orders. The pass reads its first batch, as Keras' does: some pipelines draw
        their seeds only then (a shuffled `list_files` under a parallel interleave), and an iterator
        that reads nothing would leave every later epoch one order behind serial Keras'."""
        if not self._step.keras_builds_from_an_extra_pass or not keras_batches.needs_build(self._keras_model):
            return
        next(iter(dataset), None)
        self._keras_model._symbolic_build(data_batch=dataset.element_spec)

    def _callbacks_for_this_rank(self, user_callbacks):
        chosen = callbacks_module.for_this_rank(user_callbacks, self._comm)
        wants_local = any(isinstance(c, callbacks_module.Callback) and not c.aggregate_logs for c in chosen)
        if wants_local:
            self._step.refuse_unless("rank_local_logs",
                                     "tnt.keras.callbacks.Callback(aggregate_logs=False) (rank-local logs)",
                                     "Use aggregate_logs=True (global logs), or the TensorFlow backend.")
        if self._distributed:
            self._track_local_metrics(wants_local)
        return chosen

    def _verbosity(self, verbose):
        on_master = self._comm.rank == world.MASTER_RANK
        return verbose if on_master or config.output_on_all_devices() else 0

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

    def _prepare(self, element_spec, step):
        """Builds every variable the coming `step` ("train", "test" or "predict") uses, then gives
        all ranks the master's values (once, or after a change)."""
        wrapped = self._keras_model
        compiled_state = step != "predict"
        if compiled_state and _overrides(wrapped, "train_step") and not _overrides(wrapped, "call"):
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
            wrapped.compute_output_spec(symbolic)
        self.built = True
        if self._weights_synced:
            return
        variables = list(self.weights)
        for optimizer in self._step.optimizers():
            if optimizer.built:
                variables += list(optimizer.variables)
        agreement.check_same_compile_settings(self._comm, self)
        _check_same_variables_everywhere(self._comm, variables)
        _broadcast_from_master(self._comm, variables, "the broadcast of the master's weights")
        self._weights_synced = True

    def _use_masters_statistics(self):
        """Non-trainable state (e.g. BatchNormalization's moving statistics) is gathered per
        micro-batch; whenever the model is evaluated, and after training, every rank uses the
        master's. The master always has samples: row 0 of every global batch is its own."""
        if self._distributed and self.non_trainable_weights:
            _broadcast_from_master(self._comm, self.non_trainable_weights,
                                   "the broadcast of the master's non-trainable weights")

    @contextlib.contextmanager
    def _keras_output_on_master_only(self):
        """Keras' own messages (EarlyStopping's, ...) go to absl's log on the other ranks, which
        hides them by default; the user's prints still appear from every rank."""
        if self._comm.rank == world.MASTER_RANK or config.output_on_all_devices() or \
                not keras.config.is_interactive_logging_enabled():
            yield
            return
        keras.config.disable_interactive_logging()
        try:
            yield
        finally:
            keras.config.enable_interactive_logging()


class _BatchSources:
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


class Sequential(Model):
    """A tnt.Model around a keras.Sequential: `tnt.Sequential(layers)` is
    `tnt.Model(keras.Sequential(layers))`; `add` and `pop` are keras.Sequential's."""

    def __init__(self, layers=None, name=None, trainable=True, synchronized_batch_normalization=False):
        super().__init__(keras.Sequential(layers, trainable=trainable, name=name),
                         synchronized_batch_normalization=synchronized_batch_normalization)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A new tnt.Sequential from the `get_config()` of a Sequential model; weights are new."""
        if "layers" not in config or "input_layers" in config:
            raise ValueError("tnt.Sequential.from_config takes the config of a Sequential model; for a "
                             "functional or serialized model use tnt.Model.from_config.")
        keras_model = keras.Sequential.from_config(copy.deepcopy(config), custom_objects=custom_objects)
        wrapper = cls.__new__(cls)  # around the rebuilt model, not a new one from layers
        Model.__init__(wrapper, keras_model)
        return wrapper


def _refuse_what_the_backend_lacks(step, model):
    """Features of tnt.Model that the backend's `step` class lacks: refused on every rank, before any
    collective, so that no rank waits for another."""
    step.check_platform()
    overridden = [method for method in ("train_step", "test_step") if _overrides(model, method)]
    if overridden:
        name = step.backend_name
        step.refuse_unless("custom_steps", f"{type(model).__name__} overrides {' and '.join(overridden)}: a custom step",
                           why=f" (tarantella builds the {name} step from Keras' built-in one)",
                           instead="Use the built-in step (customize compute_loss or the metrics instead), or the "
                                   "TensorFlow backend.")


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


def _unknown_length_spec(dataset):
    """The spec of a dataset's global batches where TensorFlow cannot tell their number, else None."""
    return dataset.element_spec if int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY else None


def _overrides(model, method):
    return getattr(type(model), method) is not getattr(keras.Model, method)


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


def _refuse_ftrl(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.Ftrl):
        raise ValueError(
            "tnt.Model does not support the Ftrl optimizer. Ftrl is an online method that updates "
            "per example (built for sparse linear models); tarantella's contract is one update per "
            "global batch, equal to serial mini-batch training, so, like the original Tarantella, it "
            "refuses Ftrl instead of changing its meaning. Use another optimizer (SGD, Adam, "
            "Adagrad, ...) or train with Ftrl serially.")


def _check_same_variables_everywhere(comm, variables):
    layout = [(tuple(v.shape), str(v.dtype)) for v in variables]
    layouts = comm.allgather(layout, "the check that all ranks built the same model")
    master = layouts[world.MASTER_RANK]
    differing = [rank for rank, other in enumerate(layouts) if other != master]
    if not differing:
        return
    culprit = differing[0]
    theirs = layouts[culprit]
    common = min(len(theirs), len(master))
    first = next((i for i in range(common) if theirs[i] != master[i]), common)
    detail = (f"rank {culprit} has {len(theirs)} variables, the master {len(master)}" if first == common else
              f"variable #{first} is {theirs[first]} on rank {culprit} but {master[first]} on the master")
    raise ValueError(
        f"The model differs between ranks (ranks {differing} differ from the master): {detail}. "
        "Every rank must build the same model and optimizer, in the same order.")


def _broadcast_from_master(comm, variables, what):
    arrays = [np.array(v.numpy(), order="C") for v in variables]
    if not arrays:
        return
    buffer = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    comm.broadcast_bytes(buffer, what)
    start = 0
    for variable, array in zip(variables, arrays):
        stop = start + array.nbytes
        variable.assign(buffer[start:stop].view(array.dtype).reshape(array.shape))
        start = stop
