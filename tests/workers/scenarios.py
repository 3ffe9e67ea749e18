"""Small programs run under the launcher by the tests; `scenarios.py NAME` runs one."""

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tarantella as tnt  # noqa: E402  (first, as users should)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def small_model(units=4):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(units, activation="softmax")(keras.layers.Dense(units)(inputs)))


def dataset(samples=64, batch=16):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(samples, 6)).astype("float32"), rng.integers(0, 4, samples)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def compiled(model=None, **compile_args):
    model = tnt.Model(model or small_model())
    model.compile(compile_args.pop("optimizer", "sgd"), "sparse_categorical_crossentropy",
                  metrics=["accuracy"], **compile_args)
    return model


def report(message):
    # One write per line: print() writes text and newline separately, and mpiexec merges the
    # ranks' output, so another rank's line could land in between.
    sys.stdout.write(f"rank {tnt.get_rank()}: {message}\n")
    sys.stdout.flush()


def identity():
    report(f"size {tnt.get_size()} master {tnt.get_master_rank()} is_master {tnt.is_master_rank()}")
    for name in sys.argv[2:]:
        report(f"{name}={os.environ.get(name)}")


class FailRank1(keras.callbacks.Callback):
    """Rank 1 fails at batch 5 (tests measure from the time it reports); the others train on."""

    def __init__(self, fail):
        super().__init__()
        self.fail = fail

    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and tnt.get_rank() == 1:
            sys.stderr.write(f"rank 1: failing at {time.time():.3f}\n")  # stdout is muted off the master
            sys.stderr.flush()
            self.fail()


def train_until_rank_1_fails(fail):
    compiled().fit(dataset().repeat(), epochs=1, steps_per_epoch=10**6, verbose=0, callbacks=[FailRank1(fail)])


def raise_on_rank_1():
    def fail():
        raise RuntimeError("deliberate failure on rank 1")
    train_until_rank_1_fails(fail)


def kill_rank_1_mid_epoch():
    train_until_rank_1_fails(lambda: os.kill(os.getpid(), signal.SIGKILL))


def exit_3_on_rank_1():
    train_until_rank_1_fails(lambda: sys.exit(3))


def exit_0_on_rank_1():
    train_until_rank_1_fails(lambda: sys.exit(0))


def os_exit_0_on_rank_1():
    train_until_rank_1_fails(lambda: os._exit(0))


def mpi_abort_on_rank_1():
    from mpi4py import MPI
    train_until_rank_1_fails(lambda: MPI.COMM_WORLD.Abort(3))


def stop_rank_1():
    train_until_rank_1_fails(lambda: os.kill(os.getpid(), signal.SIGSTOP))


class NoSpaceLeft(keras.callbacks.Callback):
    """A master-only callback whose write fails in the middle of epoch 2 (as on a full disk)."""

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 1:
            self.fail()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def fail(self):
        sys.stderr.write(f"rank {tnt.get_rank()}: failing at {time.time():.3f}\n")
        sys.stderr.flush()
        raise OSError(28, "No space left on device")


def master_callback_fails():
    """ModelCheckpoint (alone on the master) writes under a file, not a folder, at the end of
    epoch 2; or a master-only callback of the user's finds the disk full in the middle of epoch 2."""
    kind, folder = sys.argv[2], sys.argv[3]
    if kind == "checkpoint":
        class FailingCheckpoint(keras.callbacks.ModelCheckpoint):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    sys.stderr.write(f"rank {tnt.get_rank()}: failing at {time.time():.3f}\n")
                    sys.stderr.flush()
                    self.filepath = os.path.join(folder, "a-file", "model.keras")  # cannot be created
                super().on_epoch_end(epoch, logs)

        open(os.path.join(folder, "a-file"), "w").close()
        callback = FailingCheckpoint(os.path.join(folder, "model.keras"))
    else:
        callback = tnt.keras.callbacks.Callback(NoSpaceLeft(), run_on_all_ranks=False)
    compiled().fit(dataset(), epochs=4, verbose=0, callbacks=[callback])


def different_optimizers():
    """SGD on rank 0, RMSprop on rank 1: the same variables, a different training step."""
    model = tnt.Model(small_model())
    model.compile("sgd" if tnt.get_rank() == 0 else "rmsprop", "sparse_categorical_crossentropy")
    model.fit(dataset(), epochs=1, verbose=0)


def different_wires():
    """Rank 0 sends bfloat16 gradients, rank 1 float32: the bytes they exchange would not match."""
    model = tnt.Model(small_model(), gradient_wire="bfloat16" if tnt.get_rank() == 0 else "float32")
    model.compile("sgd", "sparse_categorical_crossentropy")
    model.fit(dataset(), epochs=1, verbose=0)


def master_only_save():
    """The habit from Horovod: only the master calls save, after training."""
    model = compiled()
    model.fit(dataset(), epochs=1, verbose=0)
    if tnt.is_master_rank():
        model.save(sys.argv[2])


def saves():
    """Saving edge cases in one job: a partial file left by a killed save, overwrite=False with
    every rank writing the same new file, a save into a missing folder."""
    import socket
    folder = sys.argv[2]
    model = compiled()
    abandoned = os.path.join(folder, f".tnt-partial-{socket.gethostname()}-999999999-0123456789ab-model.keras")
    if tnt.is_master_rank():
        open(abandoned, "w").close()
    model.save(os.path.join(folder, "model.keras"))
    report(f"abandoned partial file left: {os.path.exists(abandoned)}")
    outcomes = set()
    for attempt in range(10):
        try:
            model.save(os.path.join(folder, f"new-{attempt}.keras"), overwrite=False, tnt_save_all_devices=True)
            outcomes.add("saved")
        except Exception as error:
            outcomes.add(f"{type(error).__name__}: {error}")
    report(f"overwrite=False on new files: {sorted(outcomes)}")
    report_errors({"save into a missing folder": lambda: model.save(os.path.join(folder, "missing", "m.keras"))})


def evaluate_while_fit():
    """Rank 0 evaluates while rank 1 trains: both must name the two operations."""
    model = compiled()
    if tnt.get_rank() == 0:
        model.evaluate(dataset(), verbose=0)
    else:
        model.fit(dataset(), epochs=1, verbose=0)


class ReportTraining(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            sys.stderr.write(f"rank {tnt.get_rank()}: training\n")  # stdout is muted off the master
            sys.stderr.flush()


def train_until_interrupted():
    compiled().fit(dataset().repeat(), epochs=1, steps_per_epoch=10**6, verbose=0, callbacks=[ReportTraining()])


def log_messages():
    import logging
    logger = logging.getLogger("tarantella")
    logger.info("info from rank %d", tnt.get_rank())
    logger.warning("warning from rank %d", tnt.get_rank())


def different_models():
    model = small_model(units=4 if tnt.get_rank() == 0 else 5)
    compiled(model).fit(dataset(), epochs=1, verbose=0)


def uneven_steps():
    model = compiled()
    model.fit(dataset(), epochs=1, verbose=0)
    if tnt.get_rank() == 1:
        model.evaluate(dataset(), verbose=0)  # the other rank never joins this
    report("finished")


def report_errors(attempts):
    for name, attempt in attempts.items():
        try:
            attempt()
            report(f"{name}: no error")
        except Exception as error:
            report(f"{name}: {type(error).__name__}: {error}")


def bad_inputs():
    """Each mistake must raise the same clear error on every rank, with no collective started."""
    model = tnt.Model(small_model())
    report_errors({
        "fit before compile": lambda: model.fit(dataset(), verbose=0),
        "Ftrl": lambda: model.compile(keras.optimizers.Ftrl(), "mse"),
        "unknown gradient wire": lambda: tnt.Model(small_model(), gradient_wire="fp16"),
    })
    model = compiled()
    x, y = np.zeros((8, 6), np.float32), np.zeros(8)
    report_errors({
        "generator input": lambda: model.fit((sample for sample in zip(x, y)), verbose=0),
        "numpy with a wrong micro-batch": lambda: model.fit(x, y, batch_size=5, tnt_micro_batch_size=4,
                                                            verbose=0),
        "batch_size with dataset": lambda: model.fit(dataset(), batch_size=16, verbose=0),
        "unbatched dataset": lambda: model.fit(dataset().unbatch(), verbose=0),
    })
    history = model.fit(dataset(), epochs=1, verbose=0)  # the ranks still work together afterwards
    report(f"loss after errors {history.history['loss'][0]:.6f}")


def keras_output():
    model = compiled()
    model.summary()
    model.fit(dataset(), epochs=2, verbose=2)
    model.evaluate(dataset(), verbose=1)
    print(f"plain print from rank {tnt.get_rank()}", flush=True)


def batchnorm_with_empty_micro_batches():
    """Global batch 2 on 3 ranks: rank 2 never gets a sample."""
    import hashlib
    keras.utils.set_random_seed(2)
    model = tnt.Model(keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                        keras.layers.Dense(4, activation="softmax")]))
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(dataset(samples=20, batch=2), epochs=2, validation_data=dataset(samples=20, batch=2),
                        verbose=0)
    evaluation = model.evaluate(dataset(samples=20, batch=8), verbose=0)
    weights = hashlib.md5(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    report(f"history {history.history} evaluation {evaluation} weights {weights}")


def predict_uncompiled_dict_outputs():
    """x-only dataset, outputs in a dict, never compiled: compared with serial Keras predict."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(7, activation="relu")(inputs)
    plain = keras.Model(inputs, {"a": keras.layers.Dense(2)(hidden), "b": keras.layers.Dense(3)(hidden)})
    x = np.random.default_rng(0).normal(size=(23, 5)).astype("float32")
    distributed = tnt.Model(plain).predict(tf.data.Dataset.from_tensor_slices(x).batch(4), verbose=0)
    serial = plain.predict(x, batch_size=4, verbose=0)  # the wrapped model alone is serial Keras
    differences = {key: float(np.abs(distributed[key] - serial[key]).max()) for key in serial}
    report(f"shapes {sorted((k, v.shape) for k, v in distributed.items())} differences {differences}")


def xla_requested():
    model = compiled(jit_compile=True)
    history = model.fit(dataset(), epochs=1, verbose=0)
    later = compiled()
    later.jit_compile = True
    after_setting = later.jit_compile
    later.fit(dataset(), epochs=1, verbose=0)
    later.jit_compile = False
    report(f"jit_compile {model.jit_compile} loss {history.history['loss'][0]:.6f} set after compile: "
           f"{after_setting}, then {later.jit_compile}")


def on_batch_methods():
    """train_on_batch/test_on_batch/predict_on_batch with one global batch given to every rank,
    after fit, evaluate and predict on arrays (whose steps cut the rank's rows themselves), against
    the same calls on serial Keras in this process; then predict of one image."""
    def conv_model():
        keras.utils.set_random_seed(8)
        return keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, activation="relu"),
                                 keras.layers.Flatten(), keras.layers.Dense(4, activation="softmax")])

    serial, model = conv_model(), tnt.Model(conv_model())
    for m in (serial, model):
        m.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(7, 6, 6, 1)).astype("float32"), rng.integers(0, 4, 7)
    for m in (serial, model):
        m.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
        m.evaluate(x, y, batch_size=3, verbose=0)
        m.predict(x, batch_size=3, verbose=0)
    for _ in range(3):
        trained = [m.train_on_batch(x, y, return_dict=True) for m in (serial, model)]
    tested = [m.test_on_batch(x, y, return_dict=True) for m in (serial, model)]
    predicted = [m.predict_on_batch(x) for m in (serial, model)]
    one_image = [m.predict(x[:1], verbose=0) for m in (serial, model)]
    weights = max(float(np.max(np.abs(a - b))) for a, b in zip(serial.get_weights(), model.get_weights()))
    logs = max(abs(a[k] - b[k]) for a, b in (trained, tested) for k in a)
    report(f"weights {weights:.2e} logs {logs:.2e} predict_on_batch {predicted[1].shape} "
           f"{float(np.max(np.abs(predicted[0] - predicted[1]))):.2e} one image {one_image[1].shape} "
           f"{float(np.max(np.abs(one_image[0] - one_image[1]))):.2e}")


def user_prints_in_callbacks():
    """A user's callback prints on every rank; Keras' own messages come from the master only."""
    model = compiled()
    printer = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: print(f"user print from rank {tnt.get_rank()} epoch {epoch}", flush=True))
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0, verbose=1)
    model.fit(dataset(), epochs=3, verbose=0, callbacks=[printer, stopper])


def numpy_input_edges():
    """NumPy inputs: no warning Keras would not print, empty arrays as Keras, a length mismatch named."""
    import warnings
    model = compiled()
    x, y = np.ones((10, 6), "float32"), np.zeros(10, "int64")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    report(f"warnings {[str(w.message)[:50] for w in caught if 'shuffle' in str(w.message)]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        empty = model.fit(x[:0], y[:0], epochs=1, verbose=0)
    report(f"empty fit history {empty.history}")
    try:
        model.fit(x, y[:9], verbose=0)
    except ValueError as error:
        report(f"mismatch {error}")


def save_into(folder):
    """After training, every rank saves (the master writes) into `folder`."""
    model = compiled()
    model.fit(dataset(), epochs=1, verbose=0)
    if tnt.is_master_rank():
        sys.stderr.write(f"rank 0: failing at {time.time():.3f}\n")  # if the folder's disk is full
        sys.stderr.flush()
    model.save(os.path.join(folder, "model.keras"))


def step_openings(loss):
    """Trains on 70 samples in global batches of 16 (the last has 6) for 2 epochs, with
    validation, and reports the step openings and gradient rounds it ran, and its largest
    weight difference to serial Keras trained in the same process."""
    from tarantella.runtime import communicator, reducer
    counts = {"openings": 0, "rounds": 0}

    def counting(name, method):
        def counted(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)
        return counted

    communicator.Communicator.open_step = counting("openings", communicator.Communicator.open_step)
    reducer.Reducer.collect = counting("rounds", reducer.Reducer.collect)
    data = dataset(samples=70)
    losses = {"mean": "sparse_categorical_crossentropy",
              "sum": keras.losses.SparseCategoricalCrossentropy(reduction="sum")}
    trained = []
    for wrap in (tnt.Model, lambda model: model):
        model = wrap(small_model())
        model.compile("sgd", losses[loss], metrics=["accuracy"])
        model.fit(data, validation_data=data.take(2), epochs=2, verbose=0)
        trained.append(model.get_weights())
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*trained))
    report(f"openings {counts['openings']} rounds {counts['rounds']} weights differ by {difference:.2e}")


def _square_and_size(number):
    return number * number, tnt.get_size()


def worker_pool(method):
    """A pool of processes started with `method` (a data loader's workers): they import this
    file, and with it tarantella, as plain processes of their own."""
    import multiprocessing
    with multiprocessing.get_context(method).Pool(1) as pool:
        results = pool.map(_square_and_size, [2, 3])
    sys.stderr.write(f"rank {tnt.get_rank()}: {method} workers gave {results}\n")


def unseeded_shuffles():
    """A script that seeds nothing, and ranks whose NumPy and Python generators differ on purpose:
    every input that Keras or the user's PyDataset shuffles is trained in one global batch per
    epoch, whose result does not depend on the order of its rows but on which rows it holds. Each
    rank reports how far it ends from a plain Keras model trained on the unshuffled batch: far,
    unless every rank took its rows of the same shuffled batch."""
    import random
    samples = 48
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(samples, 6)).astype("float32"), rng.integers(0, 4, samples)

    class Reshuffled(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.rows = np.arange(samples)

        def __len__(self):
            return 1

        def __getitem__(self, index):
            return x[self.rows], y[self.rows]

        def on_epoch_end(self):
            np.random.shuffle(self.rows)

    inputs = {"arrays-shuffle-true": dict(x=x, y=y, batch_size=samples, shuffle=True),
              "arrays-shuffle-batch": dict(x=x, y=y, batch_size=samples, shuffle="batch"),
              "pydataset-reshuffled": dict(x=Reshuffled(), shuffle=True)}
    for name, arguments in inputs.items():
        serial = small_model()
        serial.compile("sgd", "sparse_categorical_crossentropy")
        serial.fit(x, y, batch_size=samples, epochs=3, shuffle=False, verbose=0)
        model = compiled(small_model())
        tf.random.set_seed(None)
        np.random.seed(100 + tnt.get_rank())
        random.seed(100 + tnt.get_rank())
        model.fit(**arguments, epochs=3, verbose=0)
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), serial.get_weights()))
        report(f"{name} differs from the unshuffled batch by {difference:.1e}")


SCENARIOS = {
    "unseeded-shuffles": unseeded_shuffles,
    "numpy-input-edges": numpy_input_edges,
    "on-batch-methods": on_batch_methods,
    "user-prints": user_prints_in_callbacks,
    "identity": identity,
    "raise-on-rank-1": raise_on_rank_1,
    "kill-rank-1-mid-epoch": kill_rank_1_mid_epoch,
    "exit-3-on-rank-1": exit_3_on_rank_1,
    "exit-0-on-rank-1": exit_0_on_rank_1,
    "os-exit-0-on-rank-1": os_exit_0_on_rank_1,
    "stop-rank-1": stop_rank_1,
    "mpi-abort-on-rank-1": mpi_abort_on_rank_1,
    "evaluate-while-fit": evaluate_while_fit,
    "different-optimizers": different_optimizers,
    "different-wires": different_wires,
    "master-callback-fails": master_callback_fails,
    "master-only-save": master_only_save,
    "saves": saves,
    "train-until-interrupted": train_until_interrupted,
    "log-messages": log_messages,
    "different-models": different_models,
    "uneven-steps": uneven_steps,
    "bad-inputs": bad_inputs,
    "keras-output": keras_output,
    "batchnorm-empty-micro-batches": batchnorm_with_empty_micro_batches,
    "predict-uncompiled-dict-outputs": predict_uncompiled_dict_outputs,
    "xla-requested": xla_requested,
    "step-openings": lambda: step_openings(sys.argv[2]),
    "save-into": lambda: save_into(sys.argv[2]),
    "worker-pool": lambda: worker_pool(sys.argv[2]),
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
