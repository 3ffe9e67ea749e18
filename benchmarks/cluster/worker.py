"""One rank of an emulated-cluster job (benchmarks/emulated_cluster.py): tarantella on Keras'
TensorFlow backend, training a profile model in several variants that live side by side in
this one process, each its own tnt.Model traced once:

  tnt          tarantella as it is (the fusion threshold scaled by the byte scale)
  tnt-mpi      the same model with TNT_ALLREDUCE=mpi (switched on the communicator between windows)
  one-bucket   a fusion threshold larger than the model: one bucket, handed over after backprop
  fusion-KB    another fusion threshold (nominal KiB, scaled like the default)
  compute      the gradient allreduce removed (each rank applies its own gradients): the
               compute-only step of the same ranks, the efficiency's numerator

The ring's 1 MiB cut-over (communication._RING_MIN_BYTES) is divided by the byte scale too, so
each bucket takes the algorithm its nominal size would. Commands arrive one line at a time on
the FIFO <control>/go-<rank>; the master answers each with one JSON line on <control>/results:

  window LABEL   one untimed step (the ranks fall in step), then --steps timed steps of LABEL
  probe          the link as MPI sees it: an 8-byte Sendrecv round with both ring neighbours,
                 an 8-byte Allreduce, and a ring allreduce of --probe-bytes, medians in seconds
  end            leave
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import profile_model  # noqa: E402

MICRO_BATCH = 2
ONE_BUCKET_KB = 1 << 30


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_train_batch_begin(self, batch, logs=None):
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds.append(time.perf_counter() - self._started)


def keep_own_gradients_patch():
    """GradientAllreduce.__call__ replaced by one that keeps each rank's gradients (the round's opening
    still sums the micro-batch sizes, in a collective of its own). Returns the original."""
    from tarantella import gradients
    original = gradients.GradientAllreduce.__call__

    def keep_own(self, rank_gradients, *_, opening=None, **__):
        if opening is None:
            return list(rank_gradients)
        communicator = self._comm
        open_step = lambda samples: np.float64(communicator.open_step(
            "the allreduce of micro-batch sizes", "a step without gradient allreduce", int(samples)))
        total = tf.numpy_function(open_step, [tf.cast(opening[0], tf.int64)], tf.float64, stateful=True)
        total.set_shape([])
        return list(rank_gradients), total
    gradients.GradientAllreduce.__call__ = keep_own
    return original


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", required=True)
    parser.add_argument("--scale", type=float, required=True, help="byte scale: sizes and thresholds divided by it")
    parser.add_argument("--variants", required=True, help="comma-separated labels (see the docstring)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--probe-bytes", type=int, default=1 << 16)
    parser.add_argument("--time-factor", type=float, default=1.0)
    args = parser.parse_args()

    import tarantella as tnt
    from tarantella import communication, gradients
    communication._RING_MIN_BYTES = max(1, int((1 << 20) / args.scale))
    comm = communication.init()
    rank, size = comm.rank, comm.size
    profile = profile_model.load(args.profile)
    features, labels = profile_model.data(MICRO_BATCH * size)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(MICRO_BATCH * size).repeat()
    default_kb = float(os.environ.get("TNT_FUSION_THRESHOLD", "32"))

    models, plans = {}, {}
    for label in args.variants.split(","):
        base = "tnt" if label == "tnt-mpi" else label
        if base in models:
            models[label] = models[base]
            continue
        kb = {"one-bucket": ONE_BUCKET_KB}.get(base, default_kb)
        if base.startswith("fusion-"):
            kb = float(base.split("-", 1)[1])
        os.environ["TNT_FUSION_THRESHOLD"] = repr(kb / args.scale)
        original = keep_own_gradients_patch() if base == "compute" else None
        keras.utils.set_random_seed(0)
        model = tnt.Model(profile_model.build_tensorflow(profile, args.scale, args.time_factor))
        model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=False)
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)  # traces the step
        if original is not None:
            gradients.GradientAllreduce.__call__ = original
        models[label] = models[base] = model
        plans[label] = kb
    os.environ["TNT_FUSION_THRESHOLD"] = repr(default_kb / args.scale)

    commands = open(os.path.join(args.control, f"go-{rank}"))
    results = open(os.path.join(args.control, "results"), "w") if rank == 0 else None

    def reply(message):
        if results is not None:
            results.write(json.dumps(message) + "\n")
            results.flush()

    reply({"ready": True, "ranks": size, "thresholds_kb": plans,
           "hosts": sorted(set(comm._mpi.allgather(comm.host)))})
    ring_default = comm._ring_allreduce
    while True:
        command = commands.readline().split()
        if not command:
            raise SystemExit("cluster worker: the command FIFO closed")
        if command[0] == "end":
            break
        if command[0] == "probe":
            reply(probe(comm, args.probe_bytes))
            continue
        label = command[1]
        comm._ring_allreduce = ring_default and label != "tnt-mpi"
        timer = StepTimer()
        cpu = time.process_time()
        models[label].fit(dataset, epochs=1, steps_per_epoch=1 + args.steps, verbose=0, callbacks=[timer])
        cpu = (time.process_time() - cpu) / (1 + args.steps)
        timed = timer.seconds[1:]
        reply({"label": label, "median_step_seconds": statistics.median(timed), "steps": timed,
               "cpu_seconds_per_step": cpu})


def probe(comm, nbytes, calls=200):
    """Medians, in seconds, of what the link costs MPI here (run on the main thread between windows,
    while the communicator's worker waits)."""
    from mpi4py import MPI
    world = comm._mpi
    rank, size = world.Get_rank(), world.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    small, incoming = np.zeros(1, np.float64), np.zeros(1, np.float64)
    sendrecv, allreduce, ring = [], [], []
    for call in range(calls + 10):
        world.Barrier()
        started = time.perf_counter()
        world.Sendrecv(small, dest=right, recvbuf=incoming, source=left)
        world.Sendrecv(small, dest=left, recvbuf=incoming, source=right)
        middle = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, small, op=MPI.SUM)
        if call >= 10:
            sendrecv.append((middle - started) / 2)
            allreduce.append(time.perf_counter() - middle)
    values = np.ones(max(size, nbytes // 4), np.float32)
    saved = comm._ring_allreduce
    for call in range(12):
        world.Barrier()
        started = time.perf_counter()
        comm._allreduce_bucket(values)
        if call >= 2:
            ring.append(time.perf_counter() - started)
    comm._ring_allreduce = saved
    return {"sendrecv_s": statistics.median(sendrecv), "allreduce_8_bytes_s": statistics.median(allreduce),
            "ring_bytes": int(values.nbytes), "ring_s": statistics.median(ring)}


if __name__ == "__main__":
    main()
