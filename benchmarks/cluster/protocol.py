"""The FIFO protocol between benchmarks/emulated_cluster.py and the ranks of its jobs
(benchmarks/cluster/worker.py, tarantella on Keras 3; benchmarks/cluster/horovod_worker.py,
Horovod on Keras 2): plain Python, no Keras or framework import, so that the interpreters of
both environments load it.

Commands arrive one line at a time on <control>/go-<rank>; the master (rank 0) answers each with
one JSON line on <control>/results. A window is one untimed step (the ranks fall in step) and
then the timed steps, whose median is the window's step time.
"""

import argparse
import json
import os
import statistics
import time


MICRO_BATCH = 2  # each rank's share of every global batch, in every variant of both jobs


def parser():
    """The options emulated_cluster.py gives every rank of both jobs (a worker may add its own)."""
    options = argparse.ArgumentParser()
    options.add_argument("--profile", required=True, help="a profile's name or JSON file (profile_model.load)")
    options.add_argument("--scale", type=float, required=True, help="byte scale: sizes and thresholds divided by it")
    options.add_argument("--variants", required=True, help="comma-separated labels (see the worker's docstring)")
    options.add_argument("--steps", type=int, required=True, help="timed steps per window")
    options.add_argument("--control", required=True, help="the folder of the FIFOs go-<rank> and results")
    options.add_argument("--time-factor", type=float, default=1.0, help="every wait multiplied by it")
    return options


class Control:
    """One rank's end of the FIFOs in folder `control`."""

    def __init__(self, control, rank):
        self._commands = open(os.path.join(control, f"go-{rank}"))
        self._results = open(os.path.join(control, "results"), "w") if rank == 0 else None

    def command(self):
        """The next command, split into words."""
        words = self._commands.readline().split()
        if not words:
            raise SystemExit("cluster worker: the command FIFO closed")
        return words

    def reply(self, message):
        if self._results is not None:
            self._results.write(json.dumps(message) + "\n")
            self._results.flush()


def step_timer(keras):
    """A callback of `keras` (Keras 3, or Keras 2 in Horovod's environment) that keeps each
    training step's seconds in its list `seconds`."""
    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self._started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self._started)
    return StepTimer()


def timed_window(label, fit, steps, keras):
    """Runs `fit(steps_per_epoch, callbacks)` for one untimed and `steps` timed steps: the window's
    answer (median step, every timed step, this process's CPU time per step)."""
    timer = step_timer(keras)
    cpu = time.process_time()
    fit(1 + steps, [timer])
    cpu = (time.process_time() - cpu) / (1 + steps)
    timed = timer.seconds[1:]
    return {"label": label, "median_step_seconds": statistics.median(timed), "steps": timed,
            "cpu_seconds_per_step": cpu}
