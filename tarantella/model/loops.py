"""fit, evaluate and predict of tnt.Model, and their one-batch forms: the user's call with its input
split, its callbacks chosen for the rank, its backups and epoch orders, then Keras' own loop."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import keras
import numpy as np
import tensorflow as tf
# Keras' validation_split, for arrays tarantella shuffles itself; tests/test_keras_internals.py checks it.
from keras.src.trainers.data_adapters import array_slicing

from tarantella.data import global_batches, keras_batches, pipelines
from tarantella.data.epoch_order import EpochOrder
from tarantella.model.inputs import unknown_length_spec
from tarantella.runtime import events

# What the layers above the model add to every fit (the automatic backups register here when
# tarantella is imported): functions of (the tnt.Model, the user's callbacks) that return a callback
# to run after the user's, or None. Such a callback is told the History fit returns
# (`history_returned(history)`).
FIT_CALLBACKS = []

# The types of the annotations. What fit, evaluate and predict take as inputs (as Keras does): arrays
# and tensors, a tf.data.Dataset, a keras.utils.PyDataset, a dict or list of arrays, or another
# iterable Keras' adapters take (a generator, a torch DataLoader).
InputData = Union[np.ndarray, tf.Tensor, tf.data.Dataset, keras.utils.PyDataset, Mapping[str, Any], Iterable[Any]]
# What evaluate and the one-batch methods return: the loss alone, the loss and the metrics, or a dict of them.
Scores = Union[float, list[float], dict[str, float]]
# What predict returns: the model's outputs as NumPy arrays, in the structure of the model's outputs.
Predictions = Union[np.ndarray, list[np.ndarray], tuple[np.ndarray, ...], dict[str, np.ndarray]]


class Loops:
    """The part of tnt.Model that runs the user's fit, evaluate and predict (a mixin of `Model`)."""

    def fit(self, x: InputData | None = None, y: InputData | None = None, batch_size: int | None = None,
            epochs: int = 1, verbose: str | int = "auto", callbacks: Sequence[keras.callbacks.Callback] | None = None,
            validation_split: float = 0.0, validation_data: InputData | None = None, shuffle: bool | str = True,
            class_weight: dict[int, float] | None = None, sample_weight: np.ndarray | tf.Tensor | None = None,
            initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
            validation_batch_size: int | None = None, validation_freq: int = 1,
            tnt_micro_batch_size: int | None = None, tnt_validation_micro_batch_size: int | None = None,
            tnt_distribute_dataset: bool = True, tnt_distribute_validation_dataset: bool = True,
            ) -> keras.callbacks.History:
        """Keras' fit, with global batches: every rank trains on its rows of each batch.

        Takes Keras' arguments (see `keras.Model.fit`); `batch_size` and the batches of a dataset
        are global. Besides:

        Args:
            tnt_micro_batch_size: the batch per rank: an unbatched dataset is batched with
                micro-batch x ranks, and a batched one must hold that many samples per batch.
            tnt_validation_micro_batch_size: the same for `validation_data`.
            tnt_distribute_dataset: False: each rank passes its own part of the data, batched
                with its micro-batch size, and tarantella does not split it.
            tnt_distribute_validation_dataset: the same for `validation_data`.

        Returns:
            keras.callbacks.History: the global logs, equal on every rank.

        Raises:
            RuntimeError: the model is not compiled.
            ValueError: `validation_split` with inputs other than arrays, or inputs that do not
                fit the batch sizes.
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
                unknown_length["train"] = unknown_length_spec(x)
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
        added = [c for c in (add(self, callbacks) for add in FIT_CALLBACKS) if c is not None]
        # After the user's callbacks: an epoch's backup holds what they changed at its end.
        callbacks = self._callbacks_for_this_rank(callbacks) + added + [epoch_order]
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
        for callback in added:
            callback.history_returned(history)
        self._use_masters_statistics()
        self._serial_accumulators_on_master()
        events.fit_ended(self._comm)
        return history

    def evaluate(self, x: InputData | None = None, y: InputData | None = None, batch_size: int | None = None,
                 verbose: str | int = "auto", sample_weight: np.ndarray | tf.Tensor | None = None,
                 steps: int | None = None, callbacks: Sequence[keras.callbacks.Callback] | None = None,
                 return_dict: bool = False, tnt_micro_batch_size: int | None = None,
                 tnt_distribute_dataset: bool = True, **kwargs: Any) -> Scores:
        """Keras' evaluate, with global batches; every rank returns the global loss and metrics.

        Takes Keras' arguments (see `keras.Model.evaluate`); `batch_size` and the batches of a
        dataset are global. Besides:

        Args:
            tnt_micro_batch_size: the batch per rank, as in `fit`.
            tnt_distribute_dataset: False: each rank passes its own part of the data, as in `fit`.

        Returns:
            float or list or dict: the global loss (and metrics), as Keras returns them; a dict with
            `return_dict=True`.

        Raises:
            RuntimeError: the model is not compiled.
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
            unknown_length = unknown_length_spec(x) if tnt_distribute_dataset and steps is None else None
            x = self._split("evaluate", x, tnt_distribute_dataset)
            if not tnt_distribute_dataset:
                self._check_same_step_counts(global_batches.count_batches(x), steps, "evaluation")
            if self._distributed:
                self._draw_build_pass(x)
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

    def predict(self, x: InputData, batch_size: int | None = None, verbose: str | int = "auto",
                steps: int | None = None, callbacks: Sequence[keras.callbacks.Callback] | None = None,
                tnt_micro_batch_size: int | None = None) -> Predictions:
        """Keras' predict, with global batches: every rank gets every prediction, in the order
        of the input samples.

        Takes Keras' arguments (see `keras.Model.predict`); `batch_size` and the batches of a
        dataset are global. Besides:

        Args:
            tnt_micro_batch_size: the batch per rank, as in `fit`.

        Returns:
            np.ndarray: the predictions of all samples (a list or dict of arrays for a model with
            several outputs), the same on every rank.
        """
        unbuilt = not all(layer.built for layer in self._keras_model._flatten_layers())
        if keras_batches.is_batched_by_keras(x):
            batch_size = keras_batches.keras_batch_size("predict", x, batch_size, tnt_micro_batch_size, self._comm.size)
            if self._distributed:
                self._prepare(keras_batches.first_batch_spec(x, None, None) if unbuilt else None, "predict")
            self._sources.record("predict", True, self._distributed, self)
        elif isinstance(x, tf.data.Dataset):
            global_batches.refuse_separate_arrays("predict", None, None, batch_size)
            x = self._split("predict", global_batches.global_batches("predict", x, tnt_micro_batch_size, self._comm.size),
                            distribute=True)
            if self._distributed:
                self._prepare(self._spec_to_build_from(x) if unbuilt else None, "predict")
            self._sources.record("predict", False, self._distributed, self)
        else:
            keras_batches.refuse_unknown_input("predict", x)
        self._use_masters_statistics()
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            return super().predict(x, batch_size=batch_size, verbose=self._verbosity(verbose), steps=steps,
                                   callbacks=callbacks)

    def train_on_batch(self, x: InputData, y: InputData | None = None,
                       sample_weight: np.ndarray | tf.Tensor | None = None,
                       class_weight: dict[int, float] | None = None, return_dict: bool = False) -> Scores:
        """Every rank passes the same global batch; each trains on its rows of it.

        Args:
            x: the inputs of the global batch.
            y: the targets of the global batch.
            sample_weight: one weight per sample of the global batch.
            class_weight: a weight per class index, for the loss.
            return_dict: True returns the loss and metrics as a dict.

        Returns:
            float or list or dict: the global loss (and metrics) after the update.

        Raises:
            RuntimeError: the model is not compiled.
        """
        self._check_compiled("train_on_batch")
        x, y, sample_weight = self._rows_of_batch(x, y, sample_weight, "train")
        return super().train_on_batch(x, y, sample_weight=sample_weight, class_weight=class_weight,
                                      return_dict=return_dict)

    def test_on_batch(self, x: InputData, y: InputData | None = None,
                      sample_weight: np.ndarray | tf.Tensor | None = None, return_dict: bool = False) -> Scores:
        """Every rank passes the same global batch; each tests on its rows of it.

        Args:
            x: the inputs of the global batch.
            y: the targets of the global batch.
            sample_weight: one weight per sample of the global batch.
            return_dict: True returns the loss and metrics as a dict.

        Returns:
            float or list or dict: the global loss (and metrics) of the batch.

        Raises:
            RuntimeError: the model is not compiled.
        """
        self._check_compiled("test_on_batch")
        x, y, sample_weight = self._rows_of_batch(x, y, sample_weight, "test")
        if self._distributed:
            self._use_masters_statistics()
        return super().test_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    def predict_on_batch(self, x: InputData) -> Predictions:
        """Every rank gets the predictions of the whole batch.

        Args:
            x: the inputs of the global batch, the same on every rank.

        Returns:
            np.ndarray: the predictions of the whole batch (a list or dict of arrays for a model
            with several outputs).
        """
        x, _, _ = self._rows_of_batch(x, None, None, "predict")
        if self._distributed:
            self._use_masters_statistics()
        return super().predict_on_batch(x)
