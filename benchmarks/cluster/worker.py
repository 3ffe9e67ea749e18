"""One rank of an emulated-cluster job (benchmarks/emulated_cluster.py): tarantella on the Keras
backend KERAS_BACKEND names (TensorFlow by default; JAX and PyTorch too), training a profile
model in several variants that live side by side in this one process, each its own model
traced once:

  tnt          tarantella as it is: its automatic fusion threshold for this job's ranks, nodes
               and link, which it measures on each link profile as shaped (or TNT_FUSION_THRESHOLD
               where the job sets it), nominal: scaled by the byte scale
  tnt-mpi      the same model with TNT_ALLREDUCE=mpi (switched between windows)
  one-bucket   a fusion threshold larger than the model: one bucket, handed over after backprop
  fusion-KB    another fusion threshold (nominal KiB, scaled like the default)
  after-backprop  (JAX) TNT_JAX_GRADIENT_HANDOVER=after-backprop: every bucket summed after the
               whole backprop, where `tnt` picks by placement (per bucket as XLA computes it, across hosts)
  accumulate-K Keras' gradient_accumulation_steps=K: one sum over the ranks per K micro-steps
  wire-W       tnt.Model(gradient_wire=W), W bfloat16 or float16: the gradients travel in 16 bits
  flat         the same model as tnt, its large buckets in one ring over all ranks where `tnt` sums
               them node by node (several ranks per host; switched between windows)
  compute      the same profile model as plain Keras, no tnt.Model: each rank trains alone on a
               micro-batch, the compute-only step of the same ranks, the efficiency's numerator
               (so every cost tarantella adds, not only the gradient sum, counts against it)
  ddp          (torch backend only) a peer: the same Keras model inside torch's
               DistributedDataParallel over gloo, trained by a torch loop as keras-io's DDP guide
               does it; its bucket cap (25 MB) divided by the byte scale like tarantella's threshold
  keras-dp     (JAX backend only) a peer: the same Keras model under Keras' own
               keras.distribution.DataParallel, over JAX's distributed runtime started on every rank
               (its CPU collectives over gloo), fit as Keras' distribution guide does it, each
               process feeding its own rows; XLA sums the gradients inside the jitted step

The ring's 1 MiB cut-over is divided by the byte scale too, so each bucket takes the algorithm
its nominal size would (tnt_internals.py: the one place that reaches past the public API).
Commands arrive one line at a time on the FIFO <control>/go-<rank>; the master answers each
with one JSON line on <control>/results (protocol.py, which horovod_worker.py shares):

  window LABEL   one untimed step (the ranks fall in step), then --steps timed steps of LABEL
  probe LINK     the link as MPI sees it: an 8-byte Sendrecv round with both ring neighbours,
                 an 8-byte Allreduce, and a ring allreduce of --probe-bytes, medians in seconds;
                 tarantella's own measurement of it and the threshold it picks there, with which
                 the variants that take tnt's threshold are built (once per threshold)
  link LINK      the following windows run on LINK (probed before)
  end            leave
"""

import os
import socket
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import profile_model  # noqa: E402
import protocol  # noqa: E402
import tnt_internals  # noqa: E402

MICRO_BATCH = protocol.MICRO_BATCH
ONE_BUCKET_KB = 1 << 30


def main():
    parser = protocol.parser()
    parser.add_argument("--probe-bytes", type=int, default=1 << 16)
    args = parser.parse_args()

    import tarantella as tnt
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    scaled_ring = tnt_internals.scale_ring_cut_over(args.scale)
    rank, size = tnt.get_rank(), tnt.get_size()
    data_parallel = start_keras_data_parallel(world) if "keras-dp" in args.variants.split(",") else None
    profile = profile_model.load(args.profile)
    features, labels = profile_model.data(MICRO_BATCH * size)
    fixed_kb = float(os.environ["TNT_FUSION_THRESHOLD"]) if os.environ.get("TNT_FUSION_THRESHOLD") else None
    models = {}  # (variant, nominal threshold KiB) -> (model, batch size)

    def build(label, kb):
        """(model, nominal KiB, batch size) of variant `label` with fusion threshold `kb`, built and
        traced once; variants that differ only in a switch share one. Peers and `compute` have no
        threshold (None)."""
        base = "tnt" if label in ("tnt-mpi", "flat") else label
        if base.startswith("fusion-"):
            kb = float(base.split("-", 1)[1])
        elif base == "one-bucket":
            kb = ONE_BUCKET_KB
        elif base in ("compute", "ddp", "keras-dp"):
            kb = None
        if (base, kb) not in models:
            models[base, kb] = new_model(base, kb)
        return (models[base, kb][0], kb, models[base, kb][1])

    def new_model(base, kb):
        if base == "ddp":
            model = DdpTrainer(profile, args, world)
            model.fit(features, labels, MICRO_BATCH, 1, 2, False, 0)
            return model, MICRO_BATCH
        if base == "keras-dp":
            model = KerasDataParallelTrainer(profile, args, data_parallel, rank, size)
            model.fit(features, labels, MICRO_BATCH, 1, 2, False, 0)
            return model, MICRO_BATCH
        accumulation = int(base.split("-", 1)[1]) if base.startswith("accumulate-") else None
        wire = base.split("-", 1)[1] if base.startswith("wire-") else None
        os.environ["TNT_JAX_GRADIENT_HANDOVER"] = "after-backprop" if base == "after-backprop" else "auto"
        keras.utils.set_random_seed(0)
        model = profile_model.build(profile, args.scale, args.time_factor)
        batch = MICRO_BATCH
        if base != "compute":
            os.environ["TNT_FUSION_THRESHOLD"] = repr(kb / args.scale)
            model, batch = tnt.Model(model, gradient_wire=wire), MICRO_BATCH * size
        # TensorFlow: a tf.function without XLA (the waits are host calls); JAX: Keras' jitted step
        # (un-jitted, JAX would trace every stage's custom_vjp anew at each step); torch: eager.
        model.compile(keras.optimizers.SGD(0.01, gradient_accumulation_steps=accumulation), "mse",
                      jit_compile=False if keras.backend.backend() == "tensorflow" else "auto")
        # Traces the step (both kinds of micro-step where it accumulates).
        model.fit(features, labels, batch_size=batch, epochs=1, steps_per_epoch=accumulation or 2,
                  shuffle=False, verbose=0)
        return model, batch

    variants = args.variants.split(",")
    # Those whose threshold is their own, built before the links are shaped; the others (tnt's
    # threshold) at each link's probe, where tarantella measures the link it then has.
    for label in variants:
        if label in ("compute", "one-bucket", "ddp", "keras-dp") or label.startswith("fusion-"):
            build(label, None)
    current = {}  # variant -> (model, nominal KiB) on the link of the last `probe` or `link` command
    by_link = {}

    control = protocol.Control(args.control, rank)
    reply = control.reply
    switchable = tnt_internals.use_ring(True)
    by_node = tnt_internals.use_by_node(True)
    reply({"ready": True, "ranks": size, "backend": keras.backend.backend(),
           "hosts": sorted(set(world.allgather(socket.gethostname()))), "ring_cut_over_scaled": scaled_ring,
           "allreduce_switchable": switchable, "by_node": by_node})
    while True:
        command = control.command()
        if command[0] == "end":
            break
        if command[0] == "probe":  # probe LINK: the link as shaped now; its models
            automatic = None if fixed_kb is not None else tnt_internals.automatic_threshold_kb(args.scale)
            if fixed_kb is None and automatic is None:
                raise SystemExit("cluster worker: this tarantella has no automatic fusion threshold; "
                                 "set TNT_FUSION_THRESHOLD for the tnt variant")
            default_kb = fixed_kb if fixed_kb is not None else automatic[0]
            by_link[command[1]] = {label: build(label, default_kb) for label in variants}
            current = by_link[command[1]]
            result = probe(world, args.probe_bytes)
            result.update(thresholds_kb={label: kb for label, (_, kb, _) in current.items() if kb is not None},
                          nodes=None if automatic is None else automatic[1],
                          tarantella_link=None if automatic is None else automatic[2])
            reply(result)
            continue
        if command[0] == "link":  # link LINK: the following windows run on it
            current = by_link[command[1]]
            reply({"link": command[1]})
            continue
        label = command[1]
        if label == "tnt-mpi" and not switchable:
            reply({"label": label, "unavailable": "TNT_ALLREDUCE cannot be switched inside this tarantella"})
            continue
        if label == "flat" and not by_node:
            reply({"label": label, "unavailable": "this job sums flat already (one rank per host, or "
                                                  "TNT_HIERARCHICAL_ALLREDUCE=off), or cannot switch"})
            continue
        tnt_internals.use_ring(label != "tnt-mpi")
        if by_node:
            tnt_internals.use_by_node(label != "flat")
        world.Barrier()
        model, _, batch = current[label]
        window = protocol.timed_window(label, lambda steps, callbacks: model.fit(
            features, labels, batch_size=batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
            callbacks=callbacks), args.steps, keras)
        if label.startswith("accumulate-"):  # whole cycles: one update step in K, so the mean, not the median
            window["median_step_seconds"] = statistics.fmean(window["steps"])
        reply(window)


class DdpTrainer:
    """The profile model in torch's DistributedDataParallel (gloo), a step as keras-io's guide
    "Multi-GPU distributed training with PyTorch" writes it: forward, loss, backward, step. Its
    `fit` takes what Keras' fit takes here and times each step through the callbacks."""

    def __init__(self, profile, args, world):
        import torch
        import torch.distributed as dist
        if keras.backend.backend() != "torch":
            raise SystemExit("the ddp variant needs KERAS_BACKEND=torch")
        if not dist.is_initialized():
            # The master's address as its namespace's name resolves; gloo's TCP goes through the
            # shaped link like MPI's.
            address = world.bcast(socket.gethostbyname(socket.gethostname()), root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{address}:29517", rank=world.Get_rank(),
                                    world_size=world.Get_size())
        keras.utils.set_random_seed(0)
        self.model = profile_model.build(profile, args.scale, args.time_factor)
        self.model(np.zeros((MICRO_BATCH, profile_model.WIDTH), np.float32))  # builds it
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=25 / args.scale)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.rank = world.Get_rank()

    def fit(self, features, labels, batch_size, epochs, steps_per_epoch, shuffle, verbose, callbacks=()):
        import torch
        rows = slice(self.rank * batch_size, (self.rank + 1) * batch_size)
        x, y = torch.as_tensor(features[rows]), torch.as_tensor(labels[rows])
        for step in range(steps_per_epoch):
            for callback in callbacks:
                callback.on_train_batch_begin(step)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.ddp(x), y)
            loss.backward()
            self.optimizer.step()
            for callback in callbacks:
                callback.on_train_batch_end(step)


def start_keras_data_parallel(world):
    """Keras' DataParallel over every rank's CPU device: JAX's distributed runtime (its coordinator
    on the master's host, gloo for the CPU collectives), started before JAX computes anything."""
    if keras.backend.backend() != "jax":
        raise SystemExit("the keras-dp variant needs KERAS_BACKEND=jax")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = world.bcast(socket.gethostbyname(socket.gethostname()), root=0)
    keras.distribution.initialize(job_addresses=f"{address}:29518", num_processes=world.Get_size(),
                                  process_id=world.Get_rank())
    # Each process feeds its own rows, as tarantella's ranks keep theirs.
    return keras.distribution.DataParallel(devices=keras.distribution.list_devices(), auto_shard_dataset=False)


class KerasDataParallelTrainer:
    """The profile model built, compiled and fit under Keras' DataParallel (`distribution`): the
    global batch is every process's MICRO_BATCH rows, and the step Keras jits sums the gradients
    over the processes with XLA's collectives. Its stages wait on each process's own rows
    (profile_model's `batch_mesh`). Only this trainer runs in the distribution's scope: the
    tarantella variants beside it in this process are built and fit outside it."""

    def __init__(self, profile, args, distribution, rank, size):
        self.distribution, self.rank, self.size = distribution, rank, size
        with distribution.scope():
            keras.utils.set_random_seed(0)
            self.model = profile_model.build(profile, args.scale, args.time_factor,
                                             batch_mesh=distribution.device_mesh.backend_mesh)
            self.model.compile(keras.optimizers.SGD(0.01), "mse")

    def fit(self, features, labels, batch_size, epochs, steps_per_epoch, shuffle, verbose, callbacks=()):
        with self.distribution.scope():
            self.model.fit(features[self.rank::self.size], labels[self.rank::self.size], batch_size=batch_size,
                           epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=shuffle, verbose=verbose,
                           callbacks=list(callbacks))


def probe(world, nbytes, calls=200):
    """Medians, in seconds, of what the link costs MPI here (run on the main thread between windows,
    while tarantella's worker waits)."""
    from mpi4py import MPI
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
    tnt_internals.use_ring(True)
    for call in range(12):
        world.Barrier()
        started = time.perf_counter()
        if not tnt_internals.ring_allreduce(values):
            break
        if call >= 2:
            ring.append(time.perf_counter() - started)
    return {"sendrecv_s": statistics.median(sendrecv), "allreduce_8_bytes_s": statistics.median(allreduce),
            "ring_bytes": int(values.nbytes), "ring_s": statistics.median(ring) if ring else None}


if __name__ == "__main__":
    main()
