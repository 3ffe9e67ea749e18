"""One rank of the emulated cluster's Horovod job (benchmarks/emulated_cluster.py, variant
`horovod`): Horovod 0.28.1 on Keras 2 (tf.keras of TensorFlow 2.15), run by the Python of the
environment that benchmarks/make_horovod_venv.sh builds, one rank per emulated host like
tarantella's job beside it, on the same hosts and links, under the same launcher and mpiexec.

It trains the same profile model (profile_model.build: the same stages, weights of the same
scaled sizes, the same waits and gradients; on Keras 2 here) the way Horovod's Keras guide does:
`hvd.DistributedOptimizer` around the optimizer (SGD), each rank fitting its own micro-batch of
every global batch (the rows tarantella's ranks take). Horovod's fusion threshold and cycle time
come from the environment (HOROVOD_FUSION_THRESHOLD, already divided by the byte scale by the
emulated cluster; HOROVOD_CYCLE_TIME, Horovod's default 1 ms where unset). No
BroadcastGlobalVariablesCallback: every weight starts at zero on every rank, and a broadcast
would hide whether the gradients were combined.

  horovod   the profile model with hvd.DistributedOptimizer
  keras2    (named only) the same model on Keras 2 without Horovod, each rank alone: Keras 2's
            own compute-only step, to tell Keras 2's step costs from Horovod's

Before it reports ready, it checks that Horovod averages the gradients: each rank takes its
local gradient of one step from zero weights (every weight's gradient is one value, see
profile_model), the ranks gather them, and after one step of `fit` every rank's weights must be
-rate x their mean (within 1e-4), not its own gradient's step, nor p times the mean. Each window's
answer says whether the ranks' weights still agree.

The protocol is benchmarks/cluster/worker.py's (protocol.py): commands one line at a time on
<control>/go-<rank>, the master's answers as JSON lines on <control>/results:

  window LABEL   one untimed step (the ranks fall in step), then --steps timed steps of LABEL
  end            leave

The emulated cluster stops these processes (SIGSTOP) between windows, as benchmarks/scaling.py
does: Horovod's background thread runs a cycle every millisecond even while the program waits,
and would take CPU from the variants of the other job. The ready message names the ranks' pids.
"""

import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import profile_model  # noqa: E402
import protocol  # noqa: E402

MICRO_BATCH = protocol.MICRO_BATCH
LEARNING_RATE = 0.01  # worker.py's SGD
CHECK_TOLERANCE = 1e-4


def main():
    args = protocol.parser().parse_args()

    import horovod
    import horovod.tensorflow
    import horovod.tensorflow.keras as hvd
    import keras
    gather = horovod.tensorflow.allgather_object  # what the Keras module does not export
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if hvd.local_size() > 1:  # several ranks per host: each its share of the cores, as tarantella sets
        threads = max(1, len(os.sched_getaffinity(0)) // hvd.local_size())
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)

    profile = profile_model.load(args.profile)
    features, labels = (rank_share(array, MICRO_BATCH, rank, size)
                        for array in profile_model.data(MICRO_BATCH * size))

    labels_wanted = args.variants.split(",")
    unknown = [label for label in labels_wanted if label not in ("horovod", "keras2")]
    if unknown:
        raise SystemExit(f"horovod worker: unknown variant(s) {', '.join(unknown)}")
    models = {}
    for label in labels_wanted:
        keras.utils.set_random_seed(0)
        model = profile_model.build(profile, args.scale, args.time_factor)
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        if label == "horovod":
            optimizer = hvd.DistributedOptimizer(optimizer)
        # A tf.function without XLA, as the Keras 3 ranks' (the waits are host calls).
        model.compile(optimizer, "mse", jit_compile=False)
        models[label] = model
    check = None
    if "horovod" in models:
        check = allreduce_check(models["horovod"], features[:MICRO_BATCH], labels[:MICRO_BATCH], keras, gather)
    for model in models.values():
        model.fit(features, labels, batch_size=MICRO_BATCH, epochs=1, steps_per_epoch=2, shuffle=False,
                  verbose=0)  # traces the step

    control = protocol.Control(args.control, rank)
    reply = control.reply
    gathered = gather((socket.gethostname(), os.getpid()))
    reply({"ready": True, "ranks": size, "hosts": sorted({host for host, _ in gathered}),
           "rank_pids": [pid for _, pid in gathered], "allreduce_check": check,
           "fusion_threshold_bytes": os.environ.get("HOROVOD_FUSION_THRESHOLD"),
           "cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME"),
           "versions": {"horovod": horovod.__version__, "tensorflow": tf.__version__, "keras": keras.__version__}})
    while True:
        command = control.command()
        if command[0] == "end":
            break
        if command[0] != "window" or command[1] not in models:
            reply({"label": command[-1], "unavailable": f"the Horovod job has no {' '.join(command)}"})
            continue
        label = command[1]
        gather(0)  # the ranks, continued after SIGSTOP, start together
        message = protocol.timed_window(label, lambda steps, callbacks: models[label].fit(
            features, labels, batch_size=MICRO_BATCH, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
            callbacks=callbacks), args.steps, keras)
        if label == "horovod":
            message["weights_agree"] = weights_agree(models[label], gather)
        reply(message)


def rank_share(array, micro_batch, rank, size):
    """The rows of `array` (global batches of micro_batch x size rows, one after another) that rank
    `rank` trains on: its micro-batch of every global batch, as tarantella's ranks split them."""
    batches = array.reshape(-1, size, micro_batch, *array.shape[1:])
    return np.ascontiguousarray(batches[:, rank]).reshape(-1, *array.shape[1:])


def allreduce_check(model, x, y, keras, gather):
    """One step of `fit` from zero weights: every rank's weights must be -rate x the mean of the
    ranks' local gradients (all of a weight's gradient elements are one value)."""
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    local = float(tape.gradient(loss, model.trainable_variables)[0].numpy()[0])
    gradients = gather(local)
    model.fit(x, y, batch_size=len(x), epochs=1, steps_per_epoch=1, shuffle=False, verbose=0)
    expected = -LEARNING_RATE * float(np.mean(gradients))
    weights = gather([float(w.numpy()[0]) for w in model.trainable_variables])
    got = [w[0] for w in weights]
    ok = all(abs(g - expected) <= CHECK_TOLERANCE * abs(expected) for g in got) and all(
        close(w, weights[0]) for w in weights)
    return {"local_gradients": gradients, "expected_weight": expected, "weights": got,
            "ranks_differ": len(set(gradients)) > 1, "ok": bool(ok)}


def weights_agree(model, gather):
    """Whether every rank holds the same weights (checksums gathered over the ranks; an allreduce may
    round differently on different ranks, so within 1e-6)."""
    sums = gather([float(np.sum(w.numpy(), dtype=np.float64)) for w in model.trainable_variables])
    return all(close(s, sums[0]) for s in sums)


def close(first, second, tolerance=1e-6):
    return all(abs(a - b) <= tolerance * max(abs(a), abs(b)) for a, b in zip(first, second))


if __name__ == "__main__":
    main()
