"""Callbacks under tarantella: which ranks run each one, and which logs it sees.

Published as `tnt.keras.callbacks`. Every rank's step already returns the global loss and
metrics (those of the serial run), so a callback that decides something (EarlyStopping,
ReduceLROnPlateau, LearningRateScheduler, TerminateOnNaN) runs on every rank and every rank
decides alike. Keras' callbacks that print or write files run on the master alone: one
progress bar, one CSV file, one checkpoint. `Callback` sets this for a user's own callback.
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from typing import Any

import keras

from tarantella import saving
from tarantella.common import config
from tarantella.runtime import world

__all__ = ["Callback"]

_DECIDING = (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau,
             keras.callbacks.LearningRateScheduler, keras.callbacks.TerminateOnNaN)
_PRINTING_OR_WRITING = (keras.callbacks.ProgbarLogger, keras.callbacks.CSVLogger,
                        keras.callbacks.RemoteMonitor, keras.callbacks.TensorBoard)
# These save through the model; alone on the master, their saves must not wait for the other ranks.
_SAVING = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)


class Callback(keras.callbacks.Callback):
    """Runs a Keras callback under tarantella.

    A callback passed to fit/evaluate/predict without this wrapper behaves as if wrapped
    with the defaults; Keras' printing and writing callbacks always run on the master only.

    Args:
        callback: the `keras.callbacks.Callback` to run.
        aggregate_logs: True (default) gives the callback the global logs, equal to those of a
            serial run; False gives it the values of this rank's own micro-batches.
        run_on_all_ranks: True (default) runs it on every rank; False on the master only.
        write_in_background: ModelCheckpoint only. True has Keras write each checkpoint into the
            master's temporary folder (TMPDIR) at the step, and a thread copy it into place while
            training goes on; one checkpoint is in flight at a time, and fit returns once the
            last is in place. False (default) writes it in place while training waits.

    Raises:
        TypeError: `callback` is no Keras callback, is wrapped already, or a setting is not a bool.
        ValueError: a callback that decides how every rank trains (EarlyStopping,
            ReduceLROnPlateau, LearningRateScheduler, TerminateOnNaN) with either setting False;
            `write_in_background=True` for a callback other than ModelCheckpoint.
    """

    def __init__(self, callback: keras.callbacks.Callback, aggregate_logs: bool = True,
                 run_on_all_ranks: bool = True, write_in_background: bool = False) -> None:
        super().__init__()
        if isinstance(callback, Callback):
            raise TypeError("This callback is already a tnt.keras.callbacks.Callback; wrap the Keras "
                            "callback once.")
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(f"tnt.keras.callbacks.Callback wraps a keras.callbacks.Callback; got "
                            f"{type(callback).__name__}.")
        for name, value in (("aggregate_logs", aggregate_logs), ("run_on_all_ranks", run_on_all_ranks),
                            ("write_in_background", write_in_background)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False; got {value!r}.")
        if isinstance(callback, _DECIDING) and not (aggregate_logs and run_on_all_ranks):
            raise ValueError(
                f"{type(callback).__name__} changes how every rank trains, so it must run on all ranks "
                "with the global logs: with aggregate_logs=False or run_on_all_ranks=False the ranks would "
                "decide differently (stop at different epochs, use different learning rates) and the "
                "job would diverge or hang. Pass it to fit() unwrapped.")
        if write_in_background and not isinstance(callback, keras.callbacks.ModelCheckpoint):
            raise ValueError(f"write_in_background=True applies to keras.callbacks.ModelCheckpoint; got "
                             f"{type(callback).__name__}. Leave it False for this callback.")
        self.callback = callback
        self.write_in_background = write_in_background
        self.aggregate_logs = aggregate_logs
        self.run_on_all_ranks = run_on_all_ranks and not isinstance(callback, _PRINTING_OR_WRITING + _SAVING)

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        self.callback.set_params(params)

    @property
    def async_safe(self) -> bool:
        # Keras may dispatch batch hooks asynchronously unless a callback needs them: as the callback it wraps.
        inner = self.callback
        return getattr(inner, "async_safe", False) or all(
            getattr(type(inner), hook) is getattr(keras.callbacks.Callback, hook)
            for hook in ("on_batch_end", "on_train_batch_end", "on_test_batch_end", "on_predict_batch_end"))

    def _call(self, hook, *args, logs=None, local_logs=None):
        if not self.aggregate_logs and local_logs is not None and _distributed(self.model):
            logs = local_logs()
        if self.run_on_all_ranks:
            getattr(self.callback, hook)(*args, logs=logs)
            return
        with saving.master_alone(self.write_in_background), _told_to_every_rank(self.callback, self.model):
            getattr(self.callback, hook)(*args, logs=logs)
            if hook == "on_train_end" and self.write_in_background:
                saving.wait_for_background_write()  # fit returns with the last checkpoint in place

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_train_begin", logs=logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_train_end", logs=logs, local_logs=self._local_epoch_logs)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_epoch_begin", epoch, logs=logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_epoch_end", epoch, logs=logs, local_logs=self._local_epoch_logs)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_train_batch_begin", batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_train_batch_end", batch, logs=logs, local_logs=self._local_logs)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_test_begin", logs=logs)

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_test_end", logs=logs, local_logs=self._local_logs)

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_test_batch_begin", batch, logs=logs)

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_test_batch_end", batch, logs=logs, local_logs=self._local_logs)

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_predict_begin", logs=logs)

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        self._call("on_predict_end", logs=logs)

    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._call("on_predict_batch_begin", batch, logs=logs)

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Predictions are gathered from all ranks in the step itself: every rank sees them all.
        self._call("on_predict_batch_end", batch, logs=logs)

    def _local_logs(self):
        return self.model._local_metrics_result()

    def _local_epoch_logs(self):
        # Keras validates before on_epoch_end, so the rank's training values were set aside then.
        return self.model._local_epoch_logs or self.model._local_metrics_result()


class _MastersBackupAndRestore(Callback):
    """BackupAndRestore: every rank restores the backup (all must resume alike), the master saves."""

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)

    def _call(self, hook, *args, logs=None, local_logs=None):
        if self.model._comm.rank == world.MASTER_RANK:
            with saving.master_alone(), _told_to_every_rank(self.callback, self.model):
                getattr(self.callback, hook)(*args, logs=logs)


class _WaitForMaster(keras.callbacks.Callback):
    """Last in the list on every rank: after each epoch and at the end, all ranks wait until the
    master's own callbacks are done, so the checkpoints and logs they wrote are complete."""

    def __init__(self, comm):
        super().__init__()
        self._comm = comm

    def _wait(self, moment):
        self._comm.allgather(None, f"the wait for the master's callbacks ({moment})")

    def on_epoch_end(self, epoch, logs=None):
        self._wait(f"end of epoch {epoch + 1}")

    def on_train_end(self, logs=None):
        self._wait("end of fit")

    def on_test_end(self, logs=None):
        self._wait("end of evaluation")

    def on_predict_end(self, logs=None):
        self._wait("end of predict")


class _SerialAccumulatorsBeforeMastersSaves(keras.callbacks.Callback):
    """First in the list on every rank where the model accumulates gradients and callbacks that
    may save run on the master alone: before they run, the master takes serial Keras' accumulators
    (backends/accumulation.py), at each epoch's end and at each batch where a ModelCheckpoint or
    BackupAndRestore with an integer `save_freq` saves. Their own counters run on the master only,
    so every rank counts with a copy of each (`_BatchSaves`)."""

    def __init__(self, savers):
        super().__init__()
        self._batch_saves = [_BatchSaves.of(saver) for saver in savers
                             if isinstance(saver, _SAVING) and isinstance(saver.save_freq, int)]

    def on_train_batch_end(self, batch, logs=None):
        decisions = [saves.at(batch) for saves in self._batch_saves]  # every counter advances
        if any(decisions):
            self.model._serial_accumulators_on_master()

    def on_epoch_end(self, epoch, logs=None):
        for saves in self._batch_saves:
            saves.epoch_ended()
        self.model._serial_accumulators_on_master()


class _BatchSaves:
    """When a ModelCheckpoint or BackupAndRestore with an integer `save_freq` saves inside an
    epoch, told on every rank: Keras' own count (`_should_save_on_batch`) run on a copy of the
    callback, one copy per callback for the life of the program, as the callback's own counters
    live. tests/test_keras_internals.py checks that the copy decides as the callback does."""

    _copies = weakref.WeakKeyDictionary()

    def __init__(self, saver):
        self._counter = copy.copy(saver)

    @classmethod
    def of(cls, saver):
        if saver not in cls._copies:
            cls._copies[saver] = cls(saver)
        return cls._copies[saver]

    def at(self, batch):
        return self._counter._should_save_on_batch(batch)

    def epoch_ended(self):
        if isinstance(self._counter, keras.callbacks.BackupAndRestore):
            self._counter._last_batch_seen = 0  # as its on_epoch_end does


def for_this_rank(callbacks, comm, accumulating=False):
    """The callbacks this rank passes to Keras, each set up to run where it should (`accumulating`:
    the model accumulates gradients inside cycles of micro-steps without summing them)."""
    rank = comm.rank
    chosen, master_alone = [], False
    masters_savers = []  # the callbacks the master alone runs that may save
    for callback in callbacks or []:
        wrapped = callback if isinstance(callback, Callback) else Callback(callback)
        inner = wrapped.callback
        if not (wrapped.run_on_all_ranks or isinstance(inner, _PRINTING_OR_WRITING)):
            masters_savers.append(inner)
        if isinstance(inner, keras.callbacks.BackupAndRestore):
            chosen.append(_MastersBackupAndRestore(inner))
            master_alone = True
        elif isinstance(inner, keras.callbacks.TensorBoard) and config.tensorboard_on_all_devices():
            rank_folder = f"rank_{rank}"
            if os.path.basename(os.path.normpath(inner.log_dir)) != rank_folder:  # once, if fit again
                inner.log_dir = os.path.join(inner.log_dir, rank_folder)
            chosen.append(inner)
        elif wrapped.run_on_all_ranks:
            # Unwrapped where the wrapper adds nothing: Keras recognizes its own History and
            # ProgbarLogger, and may run plain callbacks asynchronously.
            chosen.append(inner if wrapped.aggregate_logs else wrapped)
        else:
            master_alone = True
            if rank == world.MASTER_RANK:
                # Wrapped, so that its failure reaches every rank; Keras must still recognize its progress bar.
                needs_wrapper = not wrapped.aggregate_logs or not isinstance(inner, keras.callbacks.ProgbarLogger)
                chosen.append(wrapped if needs_wrapper else inner)
    if master_alone and comm.size > 1:
        chosen.append(_WaitForMaster(comm))
        if accumulating and masters_savers:
            chosen.insert(0, _SerialAccumulatorsBeforeMastersSaves(masters_savers))
    return chosen


@contextlib.contextmanager
def _told_to_every_rank(callback, model):
    """A master-only callback's error is raised here and told to the other ranks, which raise it
    at their next collective (the wait for the master at the latest) instead of timing out."""
    try:
        yield
    except Exception as error:
        comm = getattr(model, "_comm", None)
        if comm is not None and comm.peers is not None:
            comm.peers.announce_failure(f"{type(callback).__name__} on rank {comm.rank} failed: "
                                        f"{type(error).__name__}: {error}")
        raise


def _distributed(model):
    return getattr(model, "_distributed", False)
