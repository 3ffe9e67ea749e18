"""tnt.Model: a keras.Model that trains data-parallel across all ranks.

A thin wrapper: it turns the user's input into each rank's micro-batches (tarantella/data/), runs
the wrapped model's own steps through the global step of Keras' backend (a `backends.base.Step`:
`TensorFlowStep`, `JaxStep` or `TorchStep`, which make the gradients, losses and metrics those
of the serial step), gives every rank the master's
weights before the first step, and saves through saving.py. Everything else a Keras user
reads answers as the wrapped model does. With one rank, every method is plain Keras.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tarantella import backends, saving
from tarantella.backends import accumulation, fusion
from tarantella import callbacks as callbacks_module
from tarantella.common import config
from tarantella.model import batch_normalization, checks, host_copy
from tarantella.model.inputs import BatchSources, Inputs
from tarantella.model.loops import Loops
from tarantella.runtime import events, world

__all__ = ["Model", "ParallelStrategy", "Sequential"]


# Public names that answer as the wrapped model's, although keras.Model defines them on the
# wrapper too. Names tarantella changes (fit, save, ...) or that Keras' loop writes on the
# model it runs (stop_training, history, ...) are the wrapper's own.
_READ_FROM_WRAPPED = frozenset({
    "metrics", "metrics_names", "losses", "loss", "compiled_loss", "compiled_metrics", "input_spec",
    "compute_output_shape", "compute_output_spec", "compute_mask", "count_params", "get_build_config",
    "layers", "input", "output", "inputs", "outputs", "input_shape", "output_shape", "get_layer",
    "get_compile_config", "optimizer", "compute_loss", "compute_metrics",
    "get_metrics_result", "quantize", "dtype_policy", "dtype", "compute_dtype", "variable_dtype",
    "input_dtype", "supports_masking", "trainable_weights", "non_trainable_weights", "trainable_variables",
    "non_trainable_variables", "weights", "variables", "get_weights", "call_signature_parameters",
    "get_quantization_layer_structure", "quantized_build", "quantized_call", "rematerialized_call",
    "stateless_compute_loss", "load_own_variables", "save_own_variables",
})


class ParallelStrategy(enum.Enum):
    """How `tnt.Model` parallelizes training; data parallelism is the only strategy."""
    DATA = "data"


class Model(Loops, Inputs, keras.Model):
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
            on any number of ranks. (On one rank the layers stay as they are.) Saved files and
            configs hold the layers as the model's author built them.
        gradient_wire: the type the gradients travel in between ranks: "bfloat16" or "float16"
            sends half the bytes (each rank rounds its gradients once to 16 bits; they are added
            in float32, and the sum is rounded once more), "float32" sends them exactly, "auto"
            takes the variables' own type where they are all bfloat16 or all float16 (read from
            the model's dtype policy if it is not built yet), else float32. None (the default)
            takes TNT_GRADIENT_WIRE, which defaults to "auto".

    Raises:
        TypeError: `model` is not a `keras.Model`, or is a tnt.Model already, or
            `synchronized_batch_normalization` is not a bool.
        ValueError: `parallel_strategy` is not `tnt.ParallelStrategy.DATA`, or `gradient_wire`
            names no wire.
        NotImplementedError: the model overrides `train_step` or `test_step` on the JAX or
            PyTorch backend.
    """

    def __init__(self, model: keras.Model, parallel_strategy: ParallelStrategy = ParallelStrategy.DATA,
                 synchronized_batch_normalization: bool = False, gradient_wire: str | None = None) -> None:
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
        wire = config.gradient_wire() if gradient_wire is None else config.check_gradient_wire(
            gradient_wire, "tnt.Model(gradient_wire=...): ")
        checks.refuse_what_the_backend_lacks(backends.step_class(), model)
        super().__init__(name=model.name)
        self._keras_model = model
        # torch.nn.Module keeps sub-modules out of __dict__, where the lookups below read the model.
        self.__dict__["_keras_model"] = model
        self._comm = world.init()
        self._distributed = self._comm.size > 1
        if synchronized_batch_normalization and self._distributed:
            # On one rank the micro-batch is the global batch: Keras' own moments are the serial ones.
            batch_normalization.synchronize(model)
        self._weights_synced = False
        self._warned_batch_normalization = False
        self._local_epoch_logs = None
        self._sources = BatchSources()
        self._epoch_order = None  # fit's, while it runs
        variable_dtypes = ([v.dtype for v in model.trainable_variables] if model.built else
                           [model.dtype_policy.variable_dtype])
        self.gradient_wire = fusion.gradient_wire(wire, variable_dtypes)
        self._step = backends.for_model(self._comm, world.gradient_reducer(self.gradient_wire), model)
        # On TensorFlow a host-side allreduce cannot live inside an XLA cluster; JAX's jitted step
        # reaches it through callbacks. There Keras' function stays uncompiled, and the step has
        # XLA compile what lies between its collectives, where the wrapped model (Keras' own
        # resolution of "auto") would be compiled.
        self._host_allreduce_outside_xla = self._distributed and not self._step.collectives_inside_xla
        self._making_keras_functions = False
        if self._host_allreduce_outside_xla:
            self._compile_between_collectives()
        self.built = model.built

    # -- the wrapped model -------------------------------------------------------

    @property
    def model(self) -> keras.Model:
        """The wrapped Keras model, as in the original Tarantella."""
        return self._keras_model

    def __getattribute__(self, name: str) -> Any:
        if name in _READ_FROM_WRAPPED:
            wrapped = object.__getattribute__(self, "__dict__").get("_keras_model")
            if wrapped is not None:
                return getattr(wrapped, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: public attributes come from the wrapped model
        # (a GAN's generator, a custom model's own trackers and methods).
        wrapped = self.__dict__.get("_keras_model")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(wrapped, name)

    def build(self, input_shape: tuple[int | None, ...] | list[Any] | dict[str, Any] | None = None) -> None:
        self.built = True  # the wrapped model builds itself on its first call

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self._keras_model(*args, **kwargs)

    def get_config(self) -> dict[str, Any]:
        """The wrapped model's config, from which `from_config` makes a new tnt.Model.

        Returns:
            dict: the wrapped Keras model's `get_config()`, with BatchNormalization's
            `synchronized` as serial Keras has it (see `save`).
        """
        with batch_normalization.configs_as_serial_keras_writes(self._keras_model):
            return self._keras_model.get_config()

    def to_json(self, **kwargs: Any) -> str:
        """The wrapped model's `to_json()`, from the config `get_config` returns.

        Args:
            **kwargs: passed on to `json.dumps`.

        Returns:
            str: the wrapped Keras model's JSON.
        """
        with batch_normalization.configs_as_serial_keras_writes(self._keras_model):
            return self._keras_model.to_json(**kwargs)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> Model:
        """A new tnt.Model from `get_config()` (of a tnt.Model or a Keras model), or from a
        serialized model (`keras.saving.serialize_keras_object`); weights are new.

        Args:
            config: the `get_config()` of a functional or Sequential model, or a serialized model.
            custom_objects: the user's classes and functions the model needs, by name.

        Returns:
            tarantella.Model: the new model.

        Raises:
            ValueError: `config` describes neither a functional nor a Sequential model, nor names
                the class of the model.
        """
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

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Keras' summary, printed on the master only (on every rank with TNT_OUTPUT_ON_ALL_DEVICES).

        Args:
            *args: `keras.Model.summary`'s positional arguments.
            **kwargs: `keras.Model.summary`'s keyword arguments (`line_length`, `print_fn`, ...).
        """
        if self._comm.rank == world.MASTER_RANK or config.output_on_all_devices():
            self._keras_model.summary(*args, **kwargs)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Sets the weights; the master's values reach every rank before the next step.

        Args:
            weights: one array per weight, in the order of `get_weights()`.
        """
        self._keras_model.set_weights(weights)
        self._weights_synced = False  # the master's values go out before the next step

    # -- saving and loading (see saving.py) -------------------------------------------

    def save(self, filepath: str | os.PathLike, overwrite: bool = True, tnt_save_all_devices: bool = False,
             **kwargs: Any) -> None:
        """Saves the wrapped Keras model, with the optimizer state once compiled; the master writes,
        and every rank returns once the file is complete. Call it on every rank.

        The file is the one serial Keras writes: BatchNormalization layers that
        `synchronized_batch_normalization=True` switched are saved unsynchronized, and on JAX and
        PyTorch, where Keras refuses `synchronized=True`, every layer is.

        Args:
            filepath: where to write the `.keras` file.
            overwrite: False refuses to replace an existing file.
            tnt_save_all_devices: True makes every rank write, for file systems that the ranks do
                not share.
            **kwargs: passed on to `keras.Model.save`.

        Raises:
            ValueError: `filepath` is a remote URL.
            FileExistsError: `overwrite=False` and the file exists.
        """
        with self._serial_accumulators_for_save(tnt_save_all_devices):
            saving.write_whole(
                filepath, lambda partial: batch_normalization.save_as_serial_keras(self._keras_model, partial, **kwargs),
                overwrite, tnt_save_all_devices,
                frozen_write=lambda: host_copy.frozen_write(self._keras_model,
                                                            lambda copy, path: copy.save(path, **kwargs)))

    def save_weights(self, filepath: str | os.PathLike, overwrite: bool = True, tnt_save_all_devices: bool = False,
                     max_shard_size: int | float | None = None) -> None:
        """Saves the weights (and the optimizer state once compiled); the master writes, and every
        rank returns once the file is complete. Call it on every rank.

        Args:
            filepath: where to write the `.weights.h5` file.
            overwrite: False refuses to replace an existing file.
            tnt_save_all_devices: True makes every rank write, for file systems that the ranks do
                not share.
            max_shard_size: must stay None: tarantella writes one file.

        Raises:
            ValueError: `max_shard_size` is given (sharded files cannot be written whole).
            FileExistsError: `overwrite=False` and the file exists.
        """
        if max_shard_size is not None:
            raise ValueError("tnt.Model.save_weights writes one file, which appears whole or not at all; "
                             "sharded saving (max_shard_size=) is not supported. Leave max_shard_size unset.")
        with self._serial_accumulators_for_save(tnt_save_all_devices):
            saving.write_whole(filepath, self._keras_model.save_weights, overwrite, tnt_save_all_devices,
                               frozen_write=lambda: host_copy.frozen_write(self._keras_model, keras.Model.save_weights))

    def _serial_accumulators_on_master(self):
        """Where gradient accumulation is inside a cycle, the master takes serial Keras'
        accumulators (backends/accumulation.py); called on every rank, before the master may save."""
        if self._distributed:
            accumulation.gather_on_master(self._comm, self._step.locally_accumulating_optimizers())

    @contextlib.contextmanager
    def _serial_accumulators_for_save(self, every_rank_writes):
        """A save called on every rank writes serial Keras' accumulators: the master's, or, where
        every rank writes, every rank's until the file is written. A master-only callback's save
        finds them on the master already (callbacks.py)."""
        if not self._distributed or not saving.every_rank_saves():
            yield
            return
        optimizers = self._step.locally_accumulating_optimizers()
        accumulation.gather_on_master(self._comm, optimizers, everywhere=every_rank_writes)
        try:
            yield
        finally:
            if every_rank_writes:
                accumulation.count_on_master_only(self._comm, optimizers)

    def load_weights(self, filepath: str | os.PathLike, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Every rank reads the file (it must be visible to all); once compiled, the optimizer state too.

        Args:
            filepath: the saved weights.
            skip_mismatch: True skips weights whose shape differs from the model's.
            **kwargs: passed on to `keras.Model.load_weights`.
        """
        optimizer = getattr(self._keras_model, "optimizer", None)  # an uncompiled Keras model has none
        if self.compiled and self.built and optimizer is not None and not optimizer.built:
            optimizer.build(self.trainable_variables)  # else the saved optimizer state is skipped
        self._keras_model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        # At once: a BackupAndRestore loads inside fit, after the step's broadcast of the master's state.
        accumulation.count_on_master_only(self._comm, self._step.locally_accumulating_optimizers())
        self._weights_synced = False

    # -- compile, fit, evaluate, predict -----------------------------------------------

    def compile(self, *args: Any, jit_compile: bool | str = "auto", **kwargs: Any) -> None:
        """Compiles the wrapped model with the user's arguments (its own compile signature, if it
        has one); the wrapper shares its optimizer. Saved files are then complete Keras files.

        Args:
            *args: the wrapped model's compile arguments (`optimizer`, `loss`, `metrics`, ...).
            jit_compile: as in Keras. With 2 or more ranks on TensorFlow, XLA compiles the step
                between its collectives (the forward and backward pass, then the update), which
                it cannot compile; the gradients then leave once backprop has ended.
            **kwargs: the wrapped model's compile arguments, by name.

        Raises:
            ValueError: the optimizer is Ftrl, which tarantella does not support.
        """
        if checks.overrides(self._keras_model, "compile"):
            self._keras_model.compile(*args, **kwargs)
        else:
            self._keras_model.compile(*args, jit_compile=jit_compile, **kwargs)
        for optimizer in self._step.optimizers():
            checks.refuse_ftrl(optimizer)
        keras.Model.compile(self, optimizer=self._keras_model.optimizer, jit_compile=self._keras_model.jit_compile,
                            run_eagerly=getattr(self._keras_model, "run_eagerly", False),
                            steps_per_execution=getattr(self._keras_model, "steps_per_execution", 1))
        if self._host_allreduce_outside_xla:
            self._compile_between_collectives()
        self._weights_synced = False

    @property
    def jit_compile(self) -> bool:
        """Whether XLA compiles the steps, as in Keras. With several ranks on TensorFlow, XLA
        compiles each step between its collectives where the wrapped model says so, and Keras'
        own functions, which it makes while reading this, stay uncompiled."""
        if self.__dict__.get("_host_allreduce_outside_xla") and not self._making_keras_functions:
            return self._keras_model.jit_compile
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value: bool | str) -> None:
        if self.__dict__.get("_host_allreduce_outside_xla"):
            self._keras_model.jit_compile = value  # Keras' check: a model XLA cannot compile keeps False
            self._compile_between_collectives()
        else:
            keras.Model.jit_compile.fset(self, value)

    def _compile_between_collectives(self):
        """XLA compiles the step between its collectives as the wrapped model's jit_compile says;
        Keras' own functions, which would put the collectives inside XLA, stay uncompiled."""
        self._step.compile_between_collectives(self._keras_model.jit_compile)
        keras.Model.jit_compile.fset(self, False)

    # -- Keras' build hooks: where Keras has made its iterator over inputs it batches itself ---------

    # -- the steps: the wrapped model's own, made global by the backend's Step ---------------

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        return self._made("train", force, super().make_train_function, "training step")

    def make_test_function(self, force: bool = False) -> Callable[..., Any]:
        return self._made("test", force, super().make_test_function, "test step")

    def make_predict_function(self, force: bool = False) -> Callable[..., Any]:
        return self._made("predict", force, super().make_predict_function, None)

    def _made(self, kind, force, make, timed_as):
        """Keras' `kind` of function, wrapped as the backend's step needs and, with a timeline, timed."""
        attribute = BatchSources.FUNCTIONS[kind]
        new = getattr(self, attribute) is None or force
        self._making_keras_functions = True
        try:
            make(force)
        finally:
            self._making_keras_functions = False
        if new and self._distributed:
            setattr(self, attribute, self._step.wrap_function(kind, getattr(self, attribute)))
        if new and timed_as:
            setattr(self, attribute, events.timed_steps(getattr(self, attribute), timed_as))
        return getattr(self, attribute)

    # The arguments are the backend trainer's: (data) on TensorFlow and torch, (state, data) on JAX.
    def train_step(self, *step_arguments: Any) -> Any:
        if not self._distributed:
            return self._keras_model.train_step(*step_arguments)
        return self._step.train(*self._sources.rows_of_rank("train", step_arguments, self._comm))

    def test_step(self, *step_arguments: Any) -> Any:
        if not self._distributed:
            return self._keras_model.test_step(*step_arguments)
        return self._step.test(*self._sources.rows_of_rank("test", step_arguments, self._comm))

    def predict_step(self, *step_arguments: Any) -> Any:
        if not self._distributed:
            return self._keras_model.predict_step(*step_arguments)
        return self._step.predict(*self._sources.rows_of_rank("predict", step_arguments, self._comm))

    # -- one global batch, given whole to every rank ------------------------------------------

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

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._local_epoch_logs = None  # fit resets at each epoch; validation sets it after its reset
        for variable, shadow in self._step.local_metric_state or ():
            shadow.assign(variable.value)

    # -- helpers -------------------------------------------------------------------------

    def _check_compiled(self, method):
        if not self.compiled:
            raise RuntimeError(f"Call model.compile(optimizer, loss, metrics) before model.{method}().")

    def _callbacks_for_this_rank(self, user_callbacks):
        chosen = callbacks_module.for_this_rank(user_callbacks, self._comm,
                                                accumulating=bool(self._step.locally_accumulating_optimizers()))
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


class Sequential(Model):
    """A tnt.Model around a keras.Sequential: `tnt.Sequential(layers)` is
    `tnt.Model(keras.Sequential(layers))`; `add` and `pop` are keras.Sequential's.

    Args:
        layers: the model's layers, as for `keras.Sequential`.
        name: the model's name.
        trainable: False freezes the model's weights.
        synchronized_batch_normalization: as for `tnt.Model`.
    """

    def __init__(self, layers: Sequence[keras.layers.Layer] | None = None, name: str | None = None,
                 trainable: bool = True, synchronized_batch_normalization: bool = False) -> None:
        super().__init__(keras.Sequential(layers, trainable=trainable, name=name),
                         synchronized_batch_normalization=synchronized_batch_normalization)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> Sequential:
        """A new tnt.Sequential from the `get_config()` of a Sequential model; weights are new.

        Args:
            config: the `get_config()` of a Sequential model.
            custom_objects: the user's classes and functions the model needs, by name.

        Returns:
            tarantella.Sequential: the new model.

        Raises:
            ValueError: `config` is not the config of a Sequential model.
        """
        if "layers" not in config or "input_layers" in config:
            raise ValueError("tnt.Sequential.from_config takes the config of a Sequential model; for a "
                             "functional or serialized model use tnt.Model.from_config.")
        keras_model = keras.Sequential.from_config(copy.deepcopy(config), custom_objects=custom_objects)
        wrapper = cls.__new__(cls)  # around the rebuilt model, not a new one from layers
        Model.__init__(wrapper, keras_model)
        return wrapper


