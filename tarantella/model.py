"""tnt.Model: a keras.Model that trains data-parallel across all ranks.

A training step on each of p > 1 ranks:
  1. forward pass on the rank's micro-batch; local loss and metric increments;
  2. one allreduce of (micro-batch size, loss, metric increments) gives every rank the
     global batch size and the serial run's loss and metric values;
  3. backprop of the loss weighted by the rank's share of the global batch, while the
     fused gradient buckets are summed over ranks as soon as they are ready;
  4. the same optimizer update on every rank.
With one rank, every method is plain Keras.
"""

import contextlib
import enum
import os
from types import SimpleNamespace

import keras
import numpy as np
import tensorflow as tf

from tarantella import callbacks as callbacks_module
from tarantella import agreement, communication, config, data, gradients, saving

logger = communication.logger

# Below this many samples per rank, per-rank BatchNormalization statistics get noisy.
_SMALL_BATCH_NORMALIZATION_BATCH = 16

# Inputs that come in batches already, so Keras' batch_size arguments do not apply.
_BATCHED_INPUTS = (tf.data.Dataset, keras.utils.PyDataset)

_TRAINING_HOOKS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


class ParallelStrategy(enum.Enum):
    DATA = "data"


class Model(keras.Model):
    """Wraps a Keras model so that fit/evaluate/predict split every global batch across ranks."""

    def __init__(self, model, parallel_strategy=ParallelStrategy.DATA):
        if isinstance(model, Model):
            raise TypeError("This model is already a tnt.Model; wrap the plain Keras model once.")
        if not isinstance(model, keras.Model):
            raise TypeError(f"tnt.Model wraps a keras.Model; got {type(model).__name__}.")
        if parallel_strategy is not ParallelStrategy.DATA:
            raise ValueError(f"Unknown parallel_strategy {parallel_strategy!r}; the only strategy is "
                             "tnt.ParallelStrategy.DATA.")
        for hook in _TRAINING_HOOKS:
            if getattr(type(model), hook) is not getattr(keras.Model, hook):
                raise TypeError(
                    f"{type(model).__name__} overrides {hook}(). tnt.Model runs its own training step, "
                    "where gradients and metrics are combined across ranks, so custom training logic "
                    "is not supported. Move it into layers, losses or metrics, or train serially.")
        super().__init__(name=model.name)
        self._keras_model = model
        self._comm = communication.init()
        self._distributed = self._comm.size > 1
        self._weights_synced = False
        self._warned_batch_normalization = False
        # Rank-local metric values, kept only while a callback asks for them (aggregate_logs=False).
        self._local_metric_state = None
        self._local_epoch_logs = None
        self._gradient_allreduce = gradients.GradientAllreduce(self._comm, config.fusion_threshold_bytes())
        if self._distributed:
            self._jit_compile = False  # a host-side allreduce cannot live inside an XLA cluster
        self.built = model.built

    # -- the wrapped model -------------------------------------------------------

    def build(self, input_shape=None):
        self.built = True  # the wrapped model builds itself on its first call

    def call(self, inputs, training=None):
        return self._keras_model(inputs, training=training)

    def __getattr__(self, name):
        # Reached only when normal lookup fails: public attributes come from the wrapped model.
        wrapped = self.__dict__.get("_keras_model")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(wrapped, name)

    @property
    def layers(self):
        return self._keras_model.layers

    @property
    def input(self):
        return self._keras_model.input

    @property
    def output(self):
        return self._keras_model.output

    def get_layer(self, name=None, index=None):
        return self._keras_model.get_layer(name=name, index=index)

    def get_config(self):
        # The whole serialized Keras model: from_config must know its class, not only its layers.
        return keras.saving.serialize_keras_object(self._keras_model)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return saving.model_from_config(config, custom_objects)

    def to_json(self, **kwargs):
        return self._keras_model.to_json(**kwargs)

    def summary(self, *args, **kwargs):
        if self._comm.rank == communication.MASTER_RANK or config.output_on_all_devices():
            self._keras_model.summary(*args, **kwargs)

    def set_weights(self, weights):
        super().set_weights(weights)
        self._weights_synced = False  # the master's values go out before the next step

    # -- saving and loading (see saving.py) -------------------------------------------

    def save(self, filepath, overwrite=True, tnt_save_all_devices=False, **kwargs):
        """Saves the wrapped Keras model, with the optimizer state once compiled; the master writes."""
        saving.write_whole(filepath, lambda partial: self._keras_model.save(partial, **kwargs),
                           overwrite, tnt_save_all_devices)

    def save_weights(self, filepath, overwrite=True, tnt_save_all_devices=False, max_shard_size=None):
        if max_shard_size is not None:
            raise ValueError("tnt.Model.save_weights writes one file, which appears whole or not at all; "
                             "sharded saving (max_shard_size=) is not supported. Leave max_shard_size unset.")
        saving.write_whole(filepath, self._keras_model.save_weights, overwrite, tnt_save_all_devices)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Every rank reads the file (it must be visible to all); optimizer state is restored too."""
        if self.compiled and self.built and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)  # else the saved optimizer state is skipped
        self._keras_model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self._weights_synced = False

    # -- compile, fit, evaluate, predict -----------------------------------------------

    def compile(self, optimizer="rmsprop", loss=None, *args, jit_compile="auto", **kwargs):
        optimizer = keras.optimizers.get(optimizer)
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if isinstance(inner, keras.optimizers.Ftrl):
            raise ValueError(
                "tnt.Model does not support the Ftrl optimizer. Ftrl is an online method that updates "
                "per example (built for sparse linear models); tarantella's contract is one update per "
                "global batch, equal to serial mini-batch training, so, like the original Tarantella, it "
                "refuses Ftrl instead of changing its meaning. Use another optimizer (SGD, Adam, "
                "Adagrad, ...) or train with Ftrl serially.")
        if self._distributed and jit_compile not in ("auto", False, None):
            logger.warning("jit_compile=True is ignored with %d ranks: XLA cannot compile the host-side "
                           "gradient allreduce, so the step runs without XLA.", self._comm.size)
        if self._distributed:
            jit_compile = False  # Keras would pick XLA by itself on a GPU
        super().compile(optimizer, loss, *args, jit_compile=jit_compile, **kwargs)
        # The wrapped model shares the optimizer and knows the compile arguments, so a saved
        # file is a complete Keras model file, optimizer state included.
        self._keras_model.compile(self.optimizer, loss, *args, jit_compile=jit_compile, **kwargs)
        self._weights_synced = False

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, tnt_micro_batch_size=None,
            tnt_validation_micro_batch_size=None, tnt_distribute_dataset=True,
            tnt_distribute_validation_dataset=True):
        """Keras' fit; batch sizes are global. tnt_micro_batch_size batches an unbatched dataset
        with micro-batch x ranks; tnt_distribute_dataset=False means each rank passes its own shard."""
        self._check_compiled("fit")
        if validation_split:
            if isinstance(x, _BATCHED_INPUTS):
                raise ValueError("validation_split= needs array inputs; pass validation_data= (a dataset "
                                 "batched with the global batch size) instead.")
            (x, y, sample_weight), validation_data = data.split_for_validation(x, y, sample_weight,
                                                                              validation_split)
        x = self._input("fit", x, y, sample_weight, batch_size, tnt_micro_batch_size, tnt_distribute_dataset,
                        shuffle)
        if validation_data is not None:
            val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
            validation_data = self._input(
                "fit (validation_data)", val_x, val_y, val_weight, validation_batch_size or
                (batch_size if not isinstance(val_x, _BATCHED_INPUTS) else None),
                tnt_validation_micro_batch_size, tnt_distribute_validation_dataset, shuffle=False)
        if not tnt_distribute_dataset:
            self._check_same_step_counts(x, steps_per_epoch, "training")
        if validation_data is not None and not tnt_distribute_validation_dataset:
            self._check_same_step_counts(validation_data, validation_steps, "validation")
        if self._distributed:
            self._prepare(x.element_spec, compiled_state=True)
            self._warn_small_batch_normalization_batches(x, tnt_distribute_dataset)
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            history = super().fit(
                x, epochs=epochs, verbose=self._verbosity(verbose), callbacks=callbacks,
                validation_data=validation_data, class_weight=class_weight, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                validation_freq=validation_freq)
        self._use_masters_statistics()
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False, tnt_micro_batch_size=None, tnt_distribute_dataset=True,
                 **kwargs):
        if kwargs.get("_use_cached_eval_dataset"):  # validation inside fit: already distributed
            self._use_masters_statistics()
            training_logs = self._local_metrics_result() if self._local_metric_state else None
            result = super().evaluate(x, y, batch_size=batch_size, verbose=verbose, steps=steps,
                                      callbacks=callbacks, return_dict=return_dict, **kwargs)
            if training_logs is not None:  # on_epoch_end comes after validation: keep both
                validation = {f"val_{name}": value for name, value in self._local_metrics_result().items()}
                self._local_epoch_logs = {**training_logs, **validation}
            return result
        self._check_compiled("evaluate")
        x = self._input("evaluate", x, y, sample_weight, batch_size, tnt_micro_batch_size,
                        tnt_distribute_dataset)
        if not tnt_distribute_dataset:
            self._check_same_step_counts(x, steps, "evaluation")
        if self._distributed:
            self._prepare(x.element_spec, compiled_state=True)
            self._use_masters_statistics()
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            return super().evaluate(x, verbose=self._verbosity(verbose), steps=steps, callbacks=callbacks,
                                    return_dict=return_dict, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None,
                tnt_micro_batch_size=None):
        """Every rank gets every prediction, in the order of the input samples."""
        x = self._input("predict", x, None, None, batch_size, tnt_micro_batch_size, distribute=True)
        if self._distributed:
            self._prepare(x.element_spec, compiled_state=False)
            self._use_masters_statistics()
        callbacks = self._callbacks_for_this_rank(callbacks)
        with self._keras_output_on_master_only():
            return super().predict(x, verbose=self._verbosity(verbose), steps=steps, callbacks=callbacks)

    # -- the distributed steps --------------------------------------------------------

    def train_step(self, data_batch):
        if not self._distributed:
            return super().train_step(data_batch)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            local = self._local_step_values(x, y, y_pred, sample_weight)
        step = self._sum_over_ranks(local)
        self._record_local_metrics(local)
        weights = self.trainable_weights
        if weights:
            # Each rank differentiates its share of the serial loss; the allreduce sums the shares.
            terms = [(loss, share) for loss, share in ((local.data_loss, step.data_loss_weight),
                                                        (local.extra_loss, step.extra_loss_weight))
                     if loss is not None]
            grads = tape.gradient([loss for loss, _ in terms], weights, output_gradients=[
                self.optimizer.scale_loss(tf.cast(share, loss.dtype)) for loss, share in terms])
            grads = self._gradient_allreduce(_zero_if_no_samples(grads, local.batch_size))
            self.optimizer.apply_gradients(zip(grads, weights))
        return self._record_global_metrics(step)

    def test_step(self, data_batch):
        if not self._distributed:
            return super().test_step(data_batch)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data_batch)
        y_pred = self(x, training=False)
        local = self._local_step_values(x, y, y_pred, sample_weight)
        step = self._sum_over_ranks(local)
        self._record_local_metrics(local)
        return self._record_global_metrics(step)

    def predict_step(self, data_batch):
        y_pred = super().predict_step(data_batch)
        if not self._distributed:
            return y_pred
        leaves = tf.nest.flatten(y_pred)
        gathered = tf.numpy_function(self._gather_predictions, leaves, [t.dtype for t in leaves],
                                     stateful=True, name="tnt_gather_predictions")
        for full, local in zip(gathered, leaves):
            full.set_shape([None] + local.shape[1:])
        return tf.nest.pack_sequence_as(y_pred, gathered)

    def _local_step_values(self, x, y, y_pred, sample_weight):
        """Loss terms and metric increments of this rank's micro-batch; metric state is untouched."""
        summed_metrics = self._compile_metrics.variables if self._compile_metrics is not None else []
        per_batch_metrics = self._compile_loss.metrics if self._compile_loss is not None else []
        per_batch_variables = [v for metric in per_batch_metrics for v in metric.variables]
        zeros = [(v, tf.zeros(v.shape, v.dtype)) for v in summed_metrics + per_batch_variables]
        with keras.StatelessScope(state_mapping=zeros) as scope:
            data_loss = None
            if self._compile_loss is not None:
                data_loss = self._compile_loss(y, y_pred, sample_weight)
            if self._compile_metrics is not None:
                self._compile_metrics.update_state(y, y_pred, sample_weight)
        extra_losses = [self._aggregate_additional_loss(loss) for loss in self.losses]
        return SimpleNamespace(
            batch_size=tf.cast(tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0],
                               tf.float64),
            data_loss=data_loss,
            data_loss_is_summed=self._data_loss_is_summed(),
            extra_loss=tf.add_n(extra_losses) if extra_losses else None,
            summed_variables=summed_metrics,
            summed_increments=[scope.get_current_value(v) for v in summed_metrics],
            per_batch_variables=per_batch_variables,
            per_batch_increments=[scope.get_current_value(v) for v in per_batch_variables])

    def _sum_over_ranks(self, local):
        """One allreduce of everything a step needs to know about the global batch."""
        m = local.batch_size
        as_float64 = lambda t: tf.reshape(tf.cast(t, tf.float64), [-1])
        data_contribution = 0.0 if local.data_loss is None else as_float64(local.data_loss)[0] * (
            1.0 if local.data_loss_is_summed else m)
        extra_contribution = 0.0 if local.extra_loss is None else as_float64(local.extra_loss)[0] * m
        parts = [tf.stack([m, data_contribution, extra_contribution])]
        parts += [as_float64(t) for t in local.summed_increments]
        # Per-batch trackers (per-output losses) record one value per batch: weight it by the share.
        parts += [as_float64(t) * m for t in local.per_batch_increments]
        vector = tf.concat(parts, axis=0)
        summed = tf.numpy_function(self._allreduce_step_totals, [vector], tf.float64, stateful=True,
                                   name="tnt_allreduce_step_totals")
        summed.set_shape(vector.shape)
        global_batch = summed[0]
        share = tf.math.divide_no_nan(m, global_batch)
        data_loss = summed[1] if local.data_loss_is_summed else tf.math.divide_no_nan(summed[1], global_batch)
        sizes = [int(np.prod(v.shape)) for v in local.summed_variables + local.per_batch_variables]
        increments = tf.split(summed[3:], sizes) if sizes else []
        n_summed = len(local.summed_variables)
        return SimpleNamespace(
            global_batch_size=global_batch,
            loss=data_loss + tf.math.divide_no_nan(summed[2], global_batch),
            data_loss_weight=1.0 if local.data_loss_is_summed else share,
            extra_loss_weight=share,
            increments=list(zip(local.summed_variables, increments[:n_summed])) + [
                (v, tf.math.divide_no_nan(inc, global_batch))
                for v, inc in zip(local.per_batch_variables, increments[n_summed:])])

    def _record_global_metrics(self, step):
        self._loss_tracker.update_state(tf.cast(step.loss, tf.float32),
                                        sample_weight=tf.cast(step.global_batch_size, tf.float32))
        for variable, increment in step.increments:
            variable.assign_add(tf.cast(tf.reshape(increment, variable.shape), variable.dtype))
        return self.get_metrics_result()

    def _record_local_metrics(self, local):
        """Advances the rank-local copy of the metric state by this micro-batch alone."""
        if self._local_metric_state is None:
            return
        pairs = self._local_metric_state
        losses = [loss for loss in (local.data_loss, local.extra_loss) if loss is not None]
        loss = tf.add_n([tf.cast(loss, tf.float32) for loss in losses]) if losses else tf.constant(0.0)
        samples = tf.cast(local.batch_size, tf.float32)
        with keras.StatelessScope(state_mapping=[(v, shadow.read_value()) for v, shadow in pairs]) as scope:
            self._loss_tracker.update_state(tf.where(samples > 0, loss, 0.0), sample_weight=samples)
            for variable, increment in zip(local.summed_variables + local.per_batch_variables,
                                           local.summed_increments + local.per_batch_increments):
                variable.assign_add(increment)
        for variable, shadow in pairs:
            shadow.assign(scope.get_current_value(variable))

    def _local_metrics_result(self):
        """This rank's own loss and metrics (its micro-batches only), in the form of Keras' logs."""
        pairs = self._local_metric_state or []
        with keras.StatelessScope(state_mapping=[(v, shadow.read_value()) for v, shadow in pairs]):
            result = self.get_metrics_result()
        return {name: value.numpy().item() if np.ndim(value) == 0 else value.numpy()
                for name, value in result.items()}

    def _track_local_metrics(self, wanted):
        if wanted == (self._local_metric_state is not None):
            return
        self._local_metric_state = tuple(
            (v, tf.Variable(v.value, trainable=False)) for metric in self.metrics for v in metric.variables
        ) if wanted else None
        self.train_function = self.test_function = None  # retraced with or without the local copy

    def reset_metrics(self):
        super().reset_metrics()
        self._local_epoch_logs = None  # fit resets at each epoch; validation sets it after its reset
        for variable, shadow in self._local_metric_state or ():
            shadow.assign(variable.value)

    def _data_loss_is_summed(self):
        if self._compile_loss is None or not self._compile_loss._flat_losses:
            return False
        summed = {loss_fn.reduction == "sum" for _, loss_fn, _, _ in self._compile_loss._flat_losses}
        if len(summed) > 1:
            raise ValueError("The compiled losses mix reduction='sum' with averaging reductions; "
                             "tarantella needs one kind to weigh each rank's share. Use one reduction.")
        return summed.pop()

    def _allreduce_step_totals(self, vector):
        return self._comm.allreduce_sum(vector, "the allreduce of batch sizes, losses and metrics")

    def _gather_predictions(self, *arrays):
        return self._comm.allgather_interleaved_rows(list(arrays), "the gathering of predictions")

    # -- helpers -------------------------------------------------------------------------

    def _check_compiled(self, method):
        if not self.compiled:
            raise RuntimeError(f"Call model.compile(optimizer, loss, metrics) before model.{method}().")

    def _input(self, method, x, y, sample_weight, batch_size, micro_batch_size, distribute, shuffle=False):
        """The rank's dataset: global batches built from the user's input, then split (if asked)."""
        ranks = self._comm.size if distribute else 1
        dataset = data.global_batches(method, x, y, sample_weight, batch_size, micro_batch_size, ranks,
                                      shuffle)
        if not distribute:
            logger.info("%s: automatic data distribution is off; each rank uses the dataset it passed.",
                        method)
            return dataset
        return data.distribute(dataset, self._comm.rank, self._comm.size)

    def _check_same_step_counts(self, dataset, steps, purpose):
        """With data the user sharded, a rank with fewer batches would leave the others waiting."""
        if not self._distributed or steps is not None:
            return
        counts = self._comm.allgather(data.count_batches(dataset), f"the count of {purpose} batches per rank")
        if len(set(counts)) > 1:
            listing = ", ".join(f"rank {rank}: {count if count >= 0 else 'endless'}"
                                for rank, count in enumerate(counts))
            raise ValueError(
                f"With automatic distribution off, the ranks' {purpose} datasets hold different numbers of "
                f"batches ({listing}). Every rank must run the same number of steps: give each rank the "
                "same number of batches (e.g. shard, then take()), or pass the steps argument.")

    def _callbacks_for_this_rank(self, user_callbacks):
        chosen = callbacks_module.for_this_rank(user_callbacks, self._comm)
        wants_local = any(isinstance(c, callbacks_module.Callback) and not c.aggregate_logs for c in chosen)
        if self._distributed:
            self._track_local_metrics(wants_local)
        return chosen

    def _verbosity(self, verbose):
        on_master = self._comm.rank == communication.MASTER_RANK
        return verbose if on_master or config.output_on_all_devices() else 0

    def _warn_small_batch_normalization_batches(self, dataset, distributed_by_us):
        if self._warned_batch_normalization:
            return
        # The rank's dataset still shows the global batch when tarantella split it; a shard the
        # user made holds the micro-batch itself.
        batch = data.global_batch_size(dataset)
        global_batch = batch if distributed_by_us or batch is None else batch * self._comm.size
        has_batch_normalization = any(isinstance(layer, keras.layers.BatchNormalization)
                                      for layer in self._flatten_layers())
        if has_batch_normalization and global_batch is not None and \
                global_batch // self._comm.size < _SMALL_BATCH_NORMALIZATION_BATCH:
            logger.warning(
                "The model has BatchNormalization layers and micro-batches of %d samples (global batch "
                "%d over %d ranks). Each rank normalizes with the statistics of its own micro-batch, "
                "not of the global batch, so training differs from serial training and is noisy below "
                "%d samples per rank. Use a larger global batch, or fewer ranks.",
                global_batch // self._comm.size, global_batch, self._comm.size,
                _SMALL_BATCH_NORMALIZATION_BATCH)
            self._warned_batch_normalization = True

    def _prepare(self, element_spec, compiled_state):
        """Builds every variable, then gives all ranks the master's values (once, or after a change)."""
        if compiled_state:
            self._symbolic_build(data_batch=element_spec)
        elif not all(layer.built for layer in self._flatten_layers()):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(element_spec)
            symbolic = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), x)
            self.compute_output_spec(symbolic)
            self.built = True
        if self._weights_synced:
            return
        variables = list(self.weights)
        if self.compiled and self.optimizer is not None and self.optimizer.built:
            variables += list(self.optimizer.variables)
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
        if self._comm.rank == communication.MASTER_RANK or config.output_on_all_devices():
            yield
            return
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield


def _zero_if_no_samples(grads, batch_size):
    """An empty micro-batch must add nothing, but 0 * NaN is NaN: e.g. BatchNormalization's
    mean of zero samples reaches gamma's gradient as NaN * sum(dy) = NaN * 0."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    chosen = iter(tf.cond(batch_size > 0, lambda: [tf.identity(g) for g in present],
                          lambda: [tf.zeros_like(g) for g in present]))
    return [None if g is None else next(chosen) for g in grads]


def _check_same_variables_everywhere(comm, variables):
    layout = [(tuple(v.shape), str(v.dtype)) for v in variables]
    layouts = comm.allgather(layout, "the check that all ranks built the same model")
    master = layouts[communication.MASTER_RANK]
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
