"""Automatic backups of `fit`, for jobs the command restarts (`--max-restarts`) or stops on a warning signal.

With TNT_BACKUP_DIR set (the command sets it) and no BackupAndRestore of the user's, every
`fit` call gets an `AutomaticBackups` callback. The master backs up the training state (the
model's variables, random seed states included, every optimizer's and the metrics') after
every epoch, after every TNT_BACKUP_EVERY_STEPS steps, and when `fit` ends: it snapshots the state
in host memory at the step boundary (`Step.snapshot`) and writes it from a thread of its own, one
backup in flight at a time; the other ranks do not wait for it. Each `fit` call has its own file, numbered in call order, and the files
stay until the job ends well: a program restarted from its top finds a finished call's
final state and skips its training, and resumes the unfinished one where the backup left it.

With TNT_SAVE_ON_SIGNAL (`--save-on-signal`), once the ranks agreed that the cluster's warning
reached one of them (runtime/stop_request.py), the master backs up after the step at which they
learnt it, tells the command, and every rank ends the program there.

Resuming mid-epoch: Keras always starts an epoch at step 0, so the first `step` steps of the
resumed epoch are replayed: each takes its batch from the input, as the uninterrupted run
did, and trains nothing (the restored state is already past them). The input thereby
continues exactly where the backup was taken (shuffled and reshuffling datasets, arrays,
PyDatasets and file sources alike), and Keras' step numbers, callbacks and iterators are
those of the uninterrupted run.
"""

import logging
import signal
import time

import keras
import numpy as np

from tarantella import backends, saving
from tarantella.backends import accumulation
from tarantella.common import backup_files, config, rank_entry
from tarantella.model import host_copy, loops
from tarantella.runtime import world

logger = logging.getLogger("tarantella")

_fit_calls = 0  # `fit` calls of this process so far: each call's backup is found again by its number


def for_fit(model, user_callbacks):
    """This `fit` call's AutomaticBackups, or None: no TNT_BACKUP_DIR, or the user brought a
    BackupAndRestore (that one is used instead)."""
    directory = config.backup_dir()
    if directory is None:
        return None
    global _fit_calls
    _fit_calls += 1
    if any(isinstance(getattr(callback, "callback", callback), keras.callbacks.BackupAndRestore)
           for callback in user_callbacks or []):
        return None
    return AutomaticBackups(model, directory, _fit_calls, config.backup_every_steps())


class AutomaticBackups(keras.callbacks.Callback):
    """Restores this `fit` call's backup on every rank when it begins; the master backs up."""

    def __init__(self, model, directory, fit_number, every_steps):
        super().__init__()
        self._comm = model._comm
        self._directory = directory
        self._path = backup_files.path_of(directory, fit_number)
        self._fit_number = fit_number
        self._every_steps = every_steps
        self._epoch_logs = {}  # epoch -> its logs, of this call, restored ones included
        self._epoch = 0
        self._steps_done = 0  # steps of the current epoch
        self._steps_since_backup = 0
        self._latest_logs = {}
        self._resume_metrics = None  # (epoch, metric values) to set when that epoch begins
        self._steps_to_replay = 0
        self._replayed = False  # the last step was replayed, not trained
        self._skipped = False  # the call had completed before a restart: nothing trains
        self._writer = None  # the master's thread writing the backup in flight
        self._host_arrays = None  # host arrays of the last backup, reused by the next
        self._write_error = None

    # -- the state -----------------------------------------------------------------------

    def _variables(self):
        """(training state, metric state): everything a resumed fit must find as it was."""
        model = self.model
        training, seen = [], set()
        optimizers = model._step.optimizers()
        for variable in [*model.variables, *(v for optimizer in optimizers for v in optimizer.variables)]:
            if id(variable) not in seen:
                seen.add(id(variable))
                training.append(variable)
        metrics = [v for metric in model.metrics for v in metric.variables if id(v) not in seen]
        return training, metrics

    def _backup(self, epoch, step, completed=False, wait=False):
        """The master snapshots the state in host memory (the step waits for this only) and writes
        it from a thread of its own; one backup at a time is in flight, and a later one waits for
        the earlier, whose host arrays it reuses. With `wait`, returns once it is written. Called on
        every rank: inside a gradient accumulation cycle the master first takes serial Keras'
        accumulators."""
        self.model._serial_accumulators_on_master()
        if self._comm.rank != world.MASTER_RANK:
            return
        started = time.monotonic()
        self.wait_for_writer()
        copying = time.monotonic()
        training, metrics = self._variables()
        snapshot = backends.step_class().snapshot(training + metrics, self._host_arrays)
        # Host arrays are reused by the next backup; a framework's held reads are let go once written.
        self._host_arrays = snapshot if all(isinstance(value, np.ndarray) for value in snapshot) else None
        header = {"fit": self._fit_number, "epoch": epoch, "step": step, "completed": completed,
                  "metric_variables": len(metrics), "variables": [host_copy.describe(v) for v in training + metrics],
                  "logs": self._latest_logs, "history": {str(e): logs for e, logs in self._epoch_logs.items()},
                  "ranks": self._comm.size, "written_at": time.time()}
        waits = (copying - started, time.monotonic() - copying)
        self._steps_since_backup = 0
        self._writer = saving.start_writer_thread(self._write, (header, snapshot, epoch, step, waits),
                                                  "tarantella-backup")
        if wait:
            self.wait_for_writer()

    def _write(self, header, snapshot, epoch, step, waits):
        started = time.monotonic()
        try:
            arrays = [np.asarray(value) for value in snapshot]
            backup_files.write(self._path, header, arrays)
        except OSError as error:
            self._write_error = error
            return
        logger.debug("backup of fit #%d at epoch %d, step %d: %.1f MB snapshot in %.3f s after waiting %.3f s for "
                     "the previous backup, written in %.3f s", self._fit_number, epoch + 1, step,
                     sum(a.nbytes for a in arrays) / 1e6, waits[1], waits[0], time.monotonic() - started)

    def wait_for_writer(self):
        """Returns once the backup in flight is written; raises if writing it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise OSError(f"The automatic backup of fit #{self._fit_number} to {self._path} failed: {error}. Give "
                          "--backup-dir a folder with room that every rank can read (a shared file system).") \
                from None

    def _restore(self):
        """Every rank reads the backup; returns its header, or None without one."""
        if backup_files.read_header(self._path) is None:
            return None
        header, arrays = backup_files.read_arrays(self._path)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        training, metrics = self._variables()
        here = [host_copy.describe(v) for v in training + metrics]
        if here != header["variables"] or len(metrics) != header["metric_variables"]:
            difference = host_copy.first_difference(header["variables"], here, "in the backup", "here")
            raise ValueError(
                f"The backup {self._path} was not made by this fit call (#{self._fit_number} of the program): "
                f"{difference}. A restarted program must build the same models and call fit in the same order. "
                "To start afresh, remove the backup folder.")
        for variable, array in zip(training, arrays):
            variable.assign(array)
        accumulation.count_on_master_only(self._comm, self.model._step.locally_accumulating_optimizers())  # every rank read it
        self._epoch_logs = {int(e): logs for e, logs in header["history"].items()}
        self._latest_logs = header["logs"]
        if header["step"]:
            self._resume_metrics = (header["epoch"], arrays[len(training):])
        return header

    # -- Keras' hooks ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        header = self._restore()
        if header is None:
            return
        epochs = self.params.get("epochs") or 0
        if header["completed"]:
            # Restored to the call's final state; the loop runs no epoch.
            self._skipped = True
            self.model._initial_epoch = epochs
            logger.info("fit #%d had completed before the restart: its final state is restored from %s.",
                        self._fit_number, self._path)
            return
        self.model._initial_epoch = header["epoch"]
        self._steps_to_replay = header["step"]
        if self._steps_to_replay:
            # The model read once: on JAX, each read of a callback's `model` writes the state of the
            # epoch's steps into the variables, which a step then reads again instead of its own state.
            model = self.model
            model.train_function = backends.step_class().replayed_train_function(model, model.train_function, self)
        logger.info("fit #%d resumes from %s at epoch %d, step %d.", self._fit_number, self._path,
                    header["epoch"] + 1, header["step"])

    def over(self):
        """Whether the steps to replay are done (the step trains again from now on)."""
        if self._steps_to_replay > 0:
            return False
        self._replayed = False
        return True

    def replayed(self, steps):
        """Counts `steps` replayed without training; returns the logs a replayed step shows."""
        self._steps_to_replay -= steps
        self._replayed = True
        return dict(self._latest_logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps_done = 0
        if self._resume_metrics is not None and self._resume_metrics[0] == epoch:
            # Keras reset the metrics as the epoch began; the backup holds their state mid-epoch.
            _, values = self._resume_metrics
            for variable, value in zip(self._variables()[1], values):
                variable.assign(value)
            self._resume_metrics = None

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        self._steps_since_backup += done - self._steps_done
        self._steps_done = done
        if self._replayed:
            self._steps_since_backup = 0
            return
        self._latest_logs = _scalars(logs)
        if self._comm.stop_agreed:
            self._backup(self._epoch, done, wait=True)
            self._stop(self._epoch, done)
        # Not at the epoch's last step: the epoch's own backup follows at once, and would wait for this one.
        if self._every_steps and self._steps_since_backup >= self._every_steps and done != self.params.get("steps"):
            self._backup(self._epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_logs[epoch] = _scalars(logs)
        stopping = self._comm.stop_agreed  # agreed during the epoch's validation
        self._backup(epoch + 1, 0, wait=stopping)
        if stopping:
            self._stop(epoch + 1, 0)

    def _stop(self, epoch, step):
        """Every rank ends the program here, at the same step, once the master has backed up: the
        cluster's warning signal reached some rank (runtime/stop_request.py)."""
        if self._comm.rank == world.MASTER_RANK:
            where = f"epoch {epoch + 1}, step {step}" if step else f"the end of epoch {epoch}"
            rank_entry.announce(rank_entry.SAVED, f"backed up fit #{self._fit_number} at {where} in {self._path} "
                                                  f"on {signal.Signals(config.save_on_signal()).name}")
        logger.info("fit #%d saved at epoch %d, step %d on the warning signal: stopping.", self._fit_number,
                    epoch + 1, step)
        raise SystemExit(0)

    def on_train_end(self, logs=None):
        self.model._initial_epoch = None  # a later fit of this model starts where its caller says
        if not self._skipped:
            self._backup(max(self._epoch_logs, default=-1) + 1, 0, completed=True, wait=True)

    def history_returned(self, history):
        """Puts the epochs that ran before the restart in front of the History Keras returns."""
        earlier = [epoch for epoch in sorted(self._epoch_logs) if epoch not in history.epoch]
        if not earlier:
            return
        keys = set(history.history) | {key for epoch in earlier for key in self._epoch_logs[epoch]}
        history.history = {key: [self._epoch_logs[epoch].get(key) for epoch in earlier] + history.history.get(key, [])
                           for key in keys}
        history.epoch = earlier + list(history.epoch)


def _scalars(logs):
    return {key: float(value) for key, value in (logs or {}).items() if np.ndim(value) == 0}


loops.FIT_CALLBACKS.append(for_fit)
