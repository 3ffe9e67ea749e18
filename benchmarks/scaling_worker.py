"""One variant of one model for benchmarks/scaling.py, kept alive for many timed windows.

Variants:
  keras         plain Keras; tarantella is never imported
  tarantella    tnt.Model, as many ranks as the launcher starts (1 with plain `python`)
  no-allreduce  tnt.Model with the gradient allreduce replaced by the identity: the
                compute-only ceiling of a multi-rank step (on every Keras backend: the
                gradient summation of that backend's step is patched)
  sync-bn       tnt.Model(..., synchronized_batch_normalization=True)
  no-agreement  tarantella without the agreement allreduce before each collective (ablation:
                what the agreement costs; a mismatch would then go unnoticed)
  no-monitor    tarantella without the peer monitor's thread and second communicator
                (ablation: what watching the other ranks costs)
  no-agreement-no-monitor  both ablations
  timeline      tarantella recording its timeline (TNT_TIMELINE, written to the control folder)
  split         plain Keras in each process started by the launcher, on its rank's half of
                every global batch, with no communication (ranks from mpi4py; run by this
                Python or by the Horovod environment's, for Keras 3 or Keras 2)
  horovod       Horovod 0.28.1 on Keras 2: the interpreter of the environment that
                benchmarks/make_horovod_venv.sh builds runs this file (LeNet-5 and the MLP
                only: the other models' definitions need Keras 3)

The Keras backend is KERAS_BACKEND's (TensorFlow where unset); scaling.py sets it per run.

The worker trains one model on random data in a single `fit`. After the untimed warm-up
steps (tracing), and after every timed window, each rank stops between two steps and
reads its next command from its own FIFO (`--control`/go-<rank>): a blocking read, so an
idle worker takes no CPU from the variant being timed. Commands:
  window      one step that lets the ranks fall in step again, then --steps-per-window timed steps
  agreement   times the 32-byte agreement allreduce that opens every step and every
              collective outside steps, and a whole synchronous tarantella collective (2+ ranks)
  ring        times --steps-per-window bare ring allreduces (mpi4py) of the model's gradient
              bytes over the same ranks: the physical limit of the step's gradient traffic
  end         leave the loop once every window has run
The master rank answers each command with one JSON line on `--control`/results.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

BATCHES_OF_DATA = 8  # distinct random batches, repeated for as many steps as needed
SEED = 0
CLASSES = 10
AGREEMENT_CALLS = 200
AGREEMENT_WARMUP_CALLS = 20


def lenet5():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(6, 5, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 5, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(120, activation="relu"),
        keras.layers.Dense(84, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ], name="lenet5")


def mlp():
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ], name="mlp")


def resnet50():
    # 32x32 inputs instead of 224x224: the same 23.5M weights and 53 BatchNormalization layers
    # at 1/49 of the compute, so a step fits a 2-core machine.
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=CLASSES)


TRANSFORMER_VOCABULARY = 4000
TRANSFORMER_LENGTH = 128


@keras.saving.register_keras_serializable(package="tarantella_benchmarks")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token plus learned position embeddings; token 0 is padding and masked out."""

    def __init__(self, vocabulary, length, width, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, width, mask_zero=True)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, token_ids):
        positions = keras.ops.arange(keras.ops.shape(token_ids)[-1])
        return self.tokens(token_ids) + self.positions(positions)

    def compute_mask(self, token_ids, mask=None):
        return self.tokens.compute_mask(token_ids)


def transformer(width=128, heads=4, hidden=256, blocks=2):
    """A small encoder classifier: masked self-attention over padded token sequences."""
    token_ids = keras.Input((TRANSFORMER_LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(TRANSFORMER_VOCABULARY, TRANSFORMER_LENGTH, width)(token_ids)
    for _ in range(blocks):
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)  # Keras passes the mask on
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
        expanded = keras.layers.Dense(hidden, activation="relu")(x)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, keras.layers.Dense(width)(expanded)]))
    pooled = keras.layers.GlobalAveragePooling1D()(x)  # over the unmasked tokens only
    return keras.Model(token_ids, keras.layers.Dense(CLASSES, activation="softmax")(pooled), name="transformer")


# model -> (builder, global batch size). ResNet-50 and the Transformer get batches for steps
# of about 0.2-1 s on 2 cores; ResNet-50's 16 samples per rank at 2 ranks is the smallest
# micro-batch for which tarantella does not warn about per-rank BatchNormalization statistics.
MODELS = {"lenet5": (lenet5, 128), "mlp": (mlp, 128), "resnet50": (resnet50, 32), "transformer": (transformer, 64)}


def random_data(model, global_batch_size):
    """Samples and labels for BATCHES_OF_DATA global batches, the same in every variant."""
    rng = np.random.default_rng(SEED)
    samples = global_batch_size * BATCHES_OF_DATA
    if model.name == "transformer":
        x = rng.integers(1, TRANSFORMER_VOCABULARY, (samples, TRANSFORMER_LENGTH)).astype(np.int32)
        lengths = rng.integers(TRANSFORMER_LENGTH // 2, TRANSFORMER_LENGTH + 1, samples)
        x[np.arange(TRANSFORMER_LENGTH) >= lengths[:, None]] = 0  # padding
    else:
        x = rng.random((samples,) + tuple(model.input_shape[1:]), dtype=np.float32)
    y = rng.integers(0, CLASSES, samples).astype(np.int32)
    return x, y


def rank_share(array, global_batch_size, rank, ranks):
    """The rows of every global batch that `rank` trains on: a consecutive micro-batch
    (tarantella takes every ranks-th row instead; on random data the time is the same)."""
    if global_batch_size % ranks:
        raise SystemExit(f"scaling_worker: a global batch of {global_batch_size} does not split into {ranks} ranks")
    micro_batch_size = global_batch_size // ranks
    batches = array.reshape((-1, global_batch_size) + array.shape[1:])
    share = batches[:, rank * micro_batch_size:(rank + 1) * micro_batch_size]
    return share.reshape((-1,) + array.shape[1:])


class WindowedTimer(keras.callbacks.Callback):
    """Times each step; between windows, waits for the coordinator's next command."""

    def __init__(self, args, rank, is_master, communicator, ready_message):
        super().__init__()
        self._args = args
        self._ready_message = ready_message
        self._comm = communicator  # tarantella's; None for plain Keras and Horovod
        self._is_master = is_master
        self._commands = open(os.path.join(args.control, f"go-{rank}"))
        self._results = open(os.path.join(args.control, "results"), "w") if is_master else None
        self._window_ends = {args.warmup_steps + (w + 1) * (1 + args.steps_per_window) - 1
                             for w in range(args.windows)}
        self._window_ends.add(args.warmup_steps - 1)
        self._resync_steps = {end + 1 for end in self._window_ends}
        self._step_seconds = []
        self._step = 0
        self._agreed_at_start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._step_seconds.append(time.perf_counter() - self._started)
        step, self._step = self._step, self._step + 1
        # A window's first step is untimed: the ranks leave their wait at different moments.
        if step in self._resync_steps:
            self._step_seconds.clear()
            self._agreed_at_start = _agreements(self._comm)
        if step not in self._window_ends:
            return
        if step == self._args.warmup_steps - 1:
            self._reply({"ready": True, **self._ready_message})
        else:
            self._report_window()
        last = step == max(self._window_ends)
        self._obey_commands(until="end" if last else "window")

    def _report_window(self):
        seconds = self._step_seconds
        agreements = None
        if self._agreed_at_start is not None:
            agreements = (_agreements(self._comm) - self._agreed_at_start) / len(seconds)
        self._reply({"median_step_seconds": statistics.median(seconds), "mean_step_seconds": statistics.fmean(seconds),
                     "agreements_per_step": agreements})

    def _obey_commands(self, until):
        while True:
            command = self._commands.readline().strip()
            if command == until:
                return
            if command == "agreement":
                self._reply(measure_agreement(self._comm))
            elif command == "ring":
                self._reply({"median_step_seconds": measure_bare_ring(self.model, self._args.steps_per_window)})
            else:
                raise SystemExit(f"scaling_worker: expected '{until}', 'agreement' or 'ring', got {command!r}")

    def _reply(self, message):
        if self._is_master:
            self._results.write(json.dumps(message) + "\n")
            self._results.flush()


def _agreements(communicator):
    """Agreement allreduces so far; None where the revision counts none. Revisions before
    `agreements` existed opened every collective they `entered` with one."""
    return getattr(communicator, "agreements", getattr(communicator, "entered", None))


def measure_agreement(communicator):
    """Median seconds of the agreement's 32-byte allreduce alone, and of a whole synchronous
    tarantella collective of 32 bytes (worker-thread hand-off, agreement and allreduce).

    The two alternate, so that both see the same load; the first calls, which absorb the
    ranks' different wake-up times, are not counted."""
    if communicator is None or communicator.size == 1:
        return {"agreement_seconds": None, "collective_seconds": None}
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Dup()
    codes = np.zeros(4, np.int64)
    raw, whole = [], []
    for call in range(AGREEMENT_WARMUP_CALLS + AGREEMENT_CALLS):
        started = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, codes, op=MPI.SUM)
        between = time.perf_counter()
        communicator.allreduce_sum(codes, "the benchmark's 32-byte allreduce")
        if call >= AGREEMENT_WARMUP_CALLS:
            raw.append(between - started)
            whole.append(time.perf_counter() - between)
    world.Free()
    return {"agreement_seconds": statistics.median(raw), "collective_seconds": statistics.median(whole)}


def measure_bare_ring(model, calls):
    """Median seconds of a ring allreduce of the model's gradient bytes (float32) over COMM_WORLD, in
    mpi4py alone: reduce-scatter then allgather over Sendrecv with numpy adding, as tarantella's ring;
    below 1 MiB MPI's Allreduce, as tarantella. The first call is not counted."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    values = np.ones(sum(int(np.prod(v.shape)) for v in model.trainable_variables), np.float32)
    chunks = np.array_split(values, size)
    incoming = np.empty_like(chunks[0])
    right, left = (rank + 1) % size, (rank - 1) % size
    seconds = []
    for _ in range(calls + 1):
        world.Barrier()
        started = time.perf_counter()
        if values.nbytes < 1 << 20:
            world.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
        else:
            for step in range(size - 1):
                arriving = chunks[(rank - step - 1) % size]
                world.Sendrecv(chunks[(rank - step) % size], dest=right, recvbuf=incoming[:arriving.size], source=left)
                np.add(arriving, incoming[:arriving.size], out=arriving)
            for step in range(size - 1):
                world.Sendrecv(chunks[(rank + 1 - step) % size], dest=right, recvbuf=chunks[(rank - step) % size],
                               source=left)
        seconds.append(time.perf_counter() - started)
    world.Free()
    return statistics.median(seconds[1:])


def remove_gradient_allreduce(backend):
    """Each rank applies its own (share-weighted) gradients: the same compute, no gradient traffic.
    The rest of the backend's step (its opening, the metrics' allreduce) stays."""
    if backend == "jax":
        from tarantella.backends.jax.step import JaxStep
        JaxStep._sum_gradients = lambda self, sequence, grads, contributes: (grads, None)
    elif backend == "torch":
        # The hooks still copy each gradient into its bucket; no bucket is handed to the
        # communicator, and the optimizer, finding no sums, applies the rank's own gradients.
        from tarantella.backends.torch import step as torch_step
        torch_step._GradientRound._hand_over = lambda self, bucket: None
        torch_step._GradientRound.summed_gradients = lambda self: {}
    else:
        from tarantella.backends.tensorflow import gradients

        def keep_own_gradients(self, rank_gradients, *_, opening=None, **__):  # the rest varies by revision
            if opening is None:
                return list(rank_gradients)
            # The round would have opened the step: the sizes are summed in a collective of their own.
            import tarantella as tnt
            communicator = tnt.init()
            open_step = lambda samples: np.float64(communicator.open_step(
                "the allreduce of micro-batch sizes", "a step without gradient allreduce", int(samples)))
            global_samples = tf.numpy_function(open_step, [tf.cast(opening[0], tf.int64)], tf.float64, stateful=True)
            global_samples.set_shape([])
            return list(rank_gradients), global_samples
        gradients.GradientAllreduce.__call__ = keep_own_gradients


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--variant", required=True, choices=[
        "keras", "tarantella", "no-allreduce", "sync-bn", "no-agreement", "no-monitor", "no-agreement-no-monitor",
        "timeline", "split", "horovod"])
    parser.add_argument("--windows", type=int, required=True, help="timed windows")
    parser.add_argument("--steps-per-window", type=int, required=True, help="timed steps per window")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed first steps (tracing)")
    parser.add_argument("--control", required=True, help="folder with the FIFOs go-<rank> and results")
    args = parser.parse_args()
    if min(args.windows, args.steps_per_window, args.warmup_steps) < 1:
        parser.error("--windows, --steps-per-window and --warmup-steps must be at least 1")

    rank, ranks, is_master = 0, 1, True  # plain Keras: one process
    communicator, tarantella_folder, callbacks, ready = None, None, [], {}
    if args.variant == "horovod":
        import horovod.tensorflow
        import horovod.tensorflow.keras as hvd
        hvd.init()
        rank, ranks, is_master = hvd.rank(), hvd.size(), hvd.rank() == 0
        # Each rank its share of the node's cores, as tarantella gives its ranks (Horovod leaves
        # TensorFlow's defaults, every rank a thread per core).
        threads = max(1, len(os.sched_getaffinity(0)) // hvd.local_size())
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        # The coordinator stops these processes between windows (see scaling.py).
        ready["rank_pids"] = horovod.tensorflow.allgather_object(os.getpid())
        # Every rank starts from rank 0's weights, as tnt.Model sees to.
        callbacks.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    elif args.variant == "split":
        from mpi4py import MPI
        rank, ranks = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        is_master = rank == 0
        threads = max(1, len(os.sched_getaffinity(0)) // ranks)  # one node: as tarantella's launcher sets
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    elif args.variant != "keras":
        if args.variant == "timeline":
            os.environ["TNT_TIMELINE"] = os.path.join(args.control, "timeline.json")
        import tarantella as tnt
        if args.variant == "no-allreduce":
            remove_gradient_allreduce(keras.backend.backend())
        if "no-agreement" in args.variant or "no-monitor" in args.variant:
            from tarantella.runtime import communicator as communicator_module
        if "no-agreement" in args.variant:
            def enter_without_agreement(self, what, agree_on, carried=0, **_):
                self.current = what
                self.entered += 1
                return carried

            def open_step_without_agreement(self, what, sequence, samples):
                """The step's opening still sums the micro-batch sizes, in a collective of its own."""
                return int(self.allreduce_sum(np.array([samples], np.int64), what, agreed=True)[0])
            communicator_module.Communicator.enter = enter_without_agreement
            communicator_module.Communicator.open_step = open_step_without_agreement
        if "no-monitor" in args.variant:
            communicator_module.PeerMonitor = lambda side_comm, communicator: None
        communicator = tnt.init()  # also at --against revisions, whatever their modules
        rank, ranks, is_master = communicator.rank, communicator.size, tnt.is_master_rank()
        tarantella_folder = os.path.dirname(os.path.dirname(tnt.__file__))

    keras.utils.set_random_seed(SEED)
    build, global_batch_size = MODELS[args.model]
    model = build()
    parameters = model.count_params()
    samples, labels = random_data(model, global_batch_size)
    batch_size = global_batch_size
    # BENCHMARK_GRADIENT_ACCUMULATION_STEPS=k in the benchmark's environment (every variant's ranks
    # inherit it): Keras' optimizer accumulates k micro-steps per update.
    accumulation = int(os.environ.get("BENCHMARK_GRADIENT_ACCUMULATION_STEPS") or 0)
    optimizer = keras.optimizers.SGD(0.01, **({"gradient_accumulation_steps": accumulation} if accumulation else {}))
    if args.variant in ("horovod", "split"):
        # Horovod leaves the data to the program: each rank feeds its share of every global batch.
        samples, labels = (rank_share(array, global_batch_size, rank, ranks) for array in (samples, labels))
        batch_size = global_batch_size // ranks
    if args.variant == "horovod":
        optimizer = hvd.DistributedOptimizer(optimizer)
    elif args.variant not in ("keras", "split"):
        # Only where asked: older revisions (--against) have no such argument.
        model = tnt.Model(model, **({"synchronized_batch_normalization": True} if args.variant == "sync-bn" else {}))
    dataset = tf.data.Dataset.from_tensor_slices((samples, labels)).batch(batch_size).repeat()
    # Every variant on the same kind of step: on TensorFlow without XLA unless the benchmark's
    # environment has BENCHMARK_JIT_COMPILE=1 (jit_compile=True); on JAX every variant's step is
    # jitted (its collectives are callbacks inside it).
    jit_compile = os.environ.get("BENCHMARK_JIT_COMPILE") == "1" or (
        False if keras.backend.backend() == "tensorflow" else "auto")
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=jit_compile)
    if tarantella_folder is not None:  # every module of tarantella from one checkout (--against)
        ready["foreign_modules"] = sorted(
            module.__file__ for name, module in sys.modules.items()
            if name.split(".")[0] == "tarantella" and getattr(module, "__file__", None)
            and not os.path.realpath(module.__file__).startswith(os.path.realpath(tarantella_folder) + os.sep))
    ready.update(parameters=parameters, global_batch_size=global_batch_size, ranks=ranks,
                 tarantella_folder=tarantella_folder)
    callbacks.append(WindowedTimer(args, rank, is_master, communicator, ready))
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=callbacks,
              steps_per_epoch=args.warmup_steps + args.windows * (1 + args.steps_per_window))


if __name__ == "__main__":
    main()
