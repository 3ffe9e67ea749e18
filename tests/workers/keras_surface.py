"""Callbacks, saving, batch-size options and input types: tarantella next to serial Keras.

Run as `tarantella -n N -- keras_surface.py SCENARIO OUT`. Each rank trains with tarantella
and, in the same process, trains the serial Keras reference (plain keras.Model, never
wrapped); it writes what it saw to OUT/SCENARIO.rank<r>.json for the test to compare.
Files a rank writes on its own go to OUT/rank<r>/, so a test sees who wrote what.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tarantella as tnt  # noqa: E402

SAMPLES, FEATURES, CLASSES = 135, 8, 3


def arrays(samples=SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    return x, y


def build(seed=7, batch_normalization=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    if batch_normalization:
        hidden = keras.layers.BatchNormalization()(hidden)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))


def compiled(model, learning_rate=0.1, optimizer="sgd"):
    make = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer]
    model.compile(make(learning_rate), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def pair(**build_args):
    """(serial Keras model, tnt.Model) starting from the same weights."""
    return compiled(build(**build_args)), compiled(tnt.Model(build(**build_args)))


def weights_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a.get_weights(), b.get_weights()))


def dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def own_folder(out):
    folder = os.path.join(out, f"rank{tnt.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    return folder


# -- scenarios ---------------------------------------------------------------------------------

def deciding_callbacks(out):
    """EarlyStopping, ReduceLROnPlateau, LearningRateScheduler, CSVLogger, ModelCheckpoint."""
    x, y = arrays()
    val_x, val_y = arrays(40, seed=1)

    def callbacks(folder):
        return [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.02, patience=1),
                keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, min_delta=0.05, patience=0),
                keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.95),
                keras.callbacks.TerminateOnNaN(),
                keras.callbacks.CSVLogger(os.path.join(folder, "log.csv")),
                keras.callbacks.ModelCheckpoint(os.path.join(folder, "best.keras"), monitor="val_loss",
                                                save_best_only=True)]

    serial, model = pair()
    serial_folder = os.path.join(out, "serial")
    os.makedirs(serial_folder, exist_ok=True)
    expected = serial.fit(dataset(x, y, 32), validation_data=dataset(val_x, val_y, 16), epochs=30,
                          verbose=0, callbacks=callbacks(serial_folder))
    folder = own_folder(out)
    history = model.fit(dataset(x, y, 32), validation_data=dataset(val_x, val_y, 16), epochs=30,
                        verbose=0, callbacks=callbacks(folder))
    best = keras.models.load_model(os.path.join(out, "rank0", "best.keras"))
    serial_best = keras.models.load_model(os.path.join(serial_folder, "best.keras"))
    return {"history": history.history, "serial_history": expected.history,
            "learning_rate": float(model.optimizer.learning_rate.numpy()),
            "serial_learning_rate": float(serial.optimizer.learning_rate.numpy()),
            "best_checkpoint_difference": weights_difference(best, serial_best),
            "weights_difference": weights_difference(model, serial)}


def terminate_on_nan(out):
    """A learning rate far too large: the loss overflows after a few batches and training stops."""
    x, y = arrays()

    def run(model):
        batches = []
        history = model.fit(dataset(x, y, 32), epochs=3, verbose=0, callbacks=[
            keras.callbacks.TerminateOnNaN(),
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))])
        return batches, len(history.history["loss"])

    serial = run(compiled(build(), learning_rate=1e18))
    mine = run(compiled(tnt.Model(build()), learning_rate=1e18))
    return {"batches": mine[0], "epochs": mine[1], "serial_batches": serial[0], "serial_epochs": serial[1]}


def writing_callbacks(out):
    """TensorBoard, RemoteMonitor and a ProgbarLogger: output from the master only."""
    x, y = arrays()
    _, model = pair()
    folder = own_folder(out)
    posts = []

    class CountingMonitor(keras.callbacks.RemoteMonitor):
        def on_epoch_end(self, epoch, logs=None):  # no server here: count what would be sent
            posts.append(epoch)

    model.fit(dataset(x, y, 32), epochs=2, verbose=2, callbacks=[
        keras.callbacks.TensorBoard(os.path.join(folder, "tensorboard")), CountingMonitor(),
        keras.callbacks.ProgbarLogger()])
    return {"posts": posts}


class Recorder(keras.callbacks.Callback):
    """Notes every hook call with its logs; the test checks where it ran and what it saw."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(["train_batch", batch, dict(logs)])

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(["epoch", epoch, dict(logs)])

    def on_test_end(self, logs=None):
        self.calls.append(["test_end", None, dict(logs)])


def custom_callbacks(out):
    """Each wrapper setting, an unwrapped callback and a LambdaCallback; SGD with rate 0 keeps the
    weights fixed, so each rank's own values can be computed here from its rows alone."""
    x, y = arrays(128)
    val_x, val_y = arrays(40, seed=1)
    settings = {"default": None, "local_all": (False, True), "global_master": (True, False),
                "local_master": (False, False)}
    recorders = {name: Recorder() for name in settings}
    callbacks = [recorders["default"]] + [
        tnt.keras.callbacks.Callback(recorders[name], aggregate_logs=aggregate, run_on_all_ranks=all_ranks)
        for name, (aggregate, all_ranks) in list(settings.items())[1:]]
    lambda_epochs = []
    callbacks.append(tnt.keras.callbacks.Callback(
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: lambda_epochs.append(epoch)),
        aggregate_logs=False, run_on_all_ranks=False))
    model = compiled(tnt.Model(build()), learning_rate=0.0)
    model.fit(dataset(x, y, 32), validation_data=dataset(val_x, val_y, 20), epochs=2, verbose=0,
              callbacks=callbacks)

    rank, size = tnt.get_rank(), tnt.get_size()
    own = lambda count, batch: np.concatenate([np.arange(start + rank, min(start + batch, count), size)
                                               for start in range(0, count, batch)])
    per_sample = lambda inputs, labels: (
        keras.losses.sparse_categorical_crossentropy(labels, model(inputs)).numpy(),
        (np.argmax(model(inputs), axis=1) == labels).astype(np.float64))
    loss, correct = per_sample(x, y)
    val_loss, val_correct = per_sample(val_x, val_y)
    rows, val_rows = own(128, 32), own(40, 20)
    expected_local = {"loss": loss[rows].mean(), "accuracy": correct[rows].mean(),
                      "val_loss": val_loss[val_rows].mean(), "val_accuracy": val_correct[val_rows].mean(),
                      "first_batch_loss": loss[rows[rows < 32]].mean()}
    expected_global = {"loss": loss.mean(), "accuracy": correct.mean(), "val_loss": val_loss.mean(),
                       "val_accuracy": val_correct.mean(), "first_batch_loss": loss[:32].mean()}
    return {"calls": {name: recorder.calls for name, recorder in recorders.items()},
            "lambda_epochs": lambda_epochs, "expected_local": expected_local,
            "expected_global": expected_global}


def wrapper_errors(out):
    errors = []
    attempts = [lambda: tnt.keras.callbacks.Callback(keras.callbacks.EarlyStopping(), run_on_all_ranks=False),
                lambda: tnt.keras.callbacks.Callback(keras.callbacks.ReduceLROnPlateau(), aggregate_logs=False),
                lambda: tnt.keras.callbacks.Callback(tnt.keras.callbacks.Callback(Recorder())),
                lambda: tnt.keras.callbacks.Callback(Recorder(), aggregate_logs="yes"),
                lambda: tnt.keras.callbacks.Callback(lambda epoch: None),
                lambda: tnt.keras.callbacks.Callback(keras.callbacks.CSVLogger("log.csv"), write_in_background=True)]
    for attempt in attempts:
        try:
            attempt()
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    return {"errors": errors}


class Batches(keras.utils.PyDataset):
    """x, y in 5 batches of 30 samples (the last 15)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return 5

    def __getitem__(self, index):
        rows = slice(index * 30, min(index * 30 + 30, len(self.x)))
        return self.x[rows], self.y[rows]


def files_reshuffled(x, y, out):
    """x, y read from record files (each holds sample numbers) in a new file order every epoch,
    through a parallel interleave, then shuffled: a pipeline that draws some of its seeds at its
    first read, not when its iterator is made (measured with TensorFlow 2.21)."""
    folder = os.path.join(out, f"records-rank{tnt.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    for part, rows in enumerate(np.array_split(np.arange(len(x)), 5)):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part{part}.tfrecord")) as writer:
            for i in rows:
                writer.write(str(i).encode())
    features, labels = tf.constant(x), tf.constant(y)
    samples = lambda record: (lambda i: (tf.gather(features, i), tf.gather(labels, i)))(
        tf.strings.to_number(record, tf.int64))
    return (tf.data.Dataset.list_files(os.path.join(folder, "*.tfrecord"), seed=7).interleave(
        tf.data.TFRecordDataset, cycle_length=2, num_parallel_calls=2, deterministic=True).shuffle(
        30, seed=2).map(samples).batch(32),), {}


# How each input kind is passed to fit: (positional arguments, keyword arguments), built afresh
# for every fit, as a restarted program builds them.
RESUMED_INPUTS = {
    "arrays-shuffled": lambda x, y, _: ((x, y), {"batch_size": 32, "shuffle": True}),
    "dataset-reshuffled": lambda x, y, _: (
        (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=3, reshuffle_each_iteration=True).batch(32),),
        {}),
    "pydataset-shuffled": lambda x, y, _: ((Batches(x, y),), {"shuffle": True}),
    "files-reshuffled": files_reshuffled,
}


def backup_and_restore(out):
    """For each shuffled input kind, a fit of 3 epochs that fails in the middle of epoch 3 on every
    rank, then a new fit with new inputs resumes it from the backup; compared with an uninterrupted fit."""
    x, y = arrays()

    class FailInEpoch3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 2 and batch == 1:
                raise RuntimeError("simulated failure")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    results = {}
    for kind, make_input in RESUMED_INPUTS.items():
        backup = os.path.join(out, f"backup-{kind}")
        def fit(model, callbacks):
            keras.utils.set_random_seed(1)  # the global seed of the program that builds the input
            arguments, options = make_input(x, y, out)
            return model.fit(*arguments, **options, epochs=3, verbose=0, callbacks=callbacks)

        reference = compiled(tnt.Model(build()), 0.01, "adam")
        fit(reference, [])
        interrupted = compiled(tnt.Model(build()), 0.01, "adam")
        try:
            fit(interrupted, [keras.callbacks.BackupAndRestore(backup), FailInEpoch3()])
        except RuntimeError:
            pass
        backup_files = sorted(os.listdir(backup))
        resumed = compiled(tnt.Model(build(seed=99)), 0.01, "adam")
        history = fit(resumed, [keras.callbacks.BackupAndRestore(backup)])
        results[kind] = {"backup_files": backup_files, "epochs_run_after_restore": len(history.history["loss"]),
                         "difference": weights_difference(resumed, reference),
                         "backup_removed": not os.path.exists(backup)}
    return results


def save_and_resume(out):
    """Whole-model and weights-only saves in the middle of training; Adam, so optimizer state counts."""
    x, y = arrays()
    folder = own_folder(out)
    train = lambda model, epochs: model.fit(dataset(x, y, 32), epochs=epochs, verbose=0)
    reference = compiled(tnt.Model(build()), 0.01, "adam")
    train(reference, 2)
    serial = compiled(build(), 0.01, "adam")
    train(serial, 2)

    model = compiled(tnt.Model(build()), 0.01, "adam")
    train(model, 1)
    model.save(os.path.join(folder, "model.keras"))
    model.save_weights(os.path.join(folder, "model.weights.h5"))
    model.save(os.path.join(folder, "everywhere.keras"), tnt_save_all_devices=True)
    tnt.models.save_model(model, os.path.join(folder, "via_function.keras"))
    shared = os.path.join(out, "rank0")
    loaded = tnt.models.load_model(os.path.join(shared, "model.keras"))
    loaded_type, loaded_compiled = type(loaded).__name__, loaded.compiled
    train(loaded, 1)
    from_weights = compiled(tnt.Model(build(seed=99)), 0.01, "adam")
    from_weights.load_weights(os.path.join(shared, "model.weights.h5"))
    train(from_weights, 1)
    # Weights loaded before compile, as Keras allows: the optimizer state in the file is skipped, as
    # serially, so the serial reference loads the same way.
    load_first = tnt.Model(build(seed=99))
    load_first.load_weights(os.path.join(shared, "model.weights.h5"))
    loaded_before_compile = weights_difference(load_first, model)
    serial_load_first = build(seed=99)
    serial_load_first.load_weights(os.path.join(shared, "model.weights.h5"))
    train(compiled(load_first, 0.01, "adam"), 1)
    train(compiled(serial_load_first, 0.01, "adam"), 1)
    uncompiled = tnt.models.load_model(os.path.join(shared, "model.keras"), compile=False)
    serial_copy = keras.models.load_model(os.path.join(shared, "model.keras"))
    return {"resumed_whole_difference": weights_difference(loaded, reference),
            "resumed_weights_difference": weights_difference(from_weights, reference),
            "reference_vs_serial": weights_difference(reference, serial),
            "loaded_before_compile_difference": loaded_before_compile,
            "trained_after_loading_before_compile_vs_serial": weights_difference(load_first, serial_load_first),
            "loaded_type": loaded_type, "loaded_compiled": loaded_compiled,
            "uncompiled": [type(uncompiled).__name__, uncompiled.compiled],
            "plain_keras_reads_it": [type(serial_copy).__name__, weights_difference(serial_copy, model)],
            "files": sorted(os.listdir(folder))}


def configs_and_weights(out):
    _, model = pair()
    x, y = arrays()
    model.fit(dataset(x, y, 32), epochs=1, verbose=0)
    copies = {"model_from_config": tnt.models.model_from_config(model.get_config()),
              "from_config": tnt.Model.from_config(model.get_config()),
              "model_from_json": tnt.models.model_from_json(model.to_json()),
              "clone_model": tnt.models.clone_model(model)}
    result = {name: [type(copy).__name__, [w.shape == v.shape for w, v in
                                           zip(copy.get_weights(), model.get_weights())].count(False)]
              for name, copy in copies.items()}
    # set_weights on one rank only: every rank then evaluates with the master's weights.
    restored = copies["model_from_config"]
    compiled(restored)
    if tnt.get_rank() == 0:
        restored.set_weights(model.get_weights())
    result["restored_evaluation"] = restored.evaluate(dataset(x, y, 32), verbose=0)
    result["trained_evaluation"] = model.evaluate(dataset(x, y, 32), verbose=0)
    result["restored_difference"] = weights_difference(restored, model)

    def stack():
        keras.utils.set_random_seed(7)
        return [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(CLASSES, activation="softmax")]

    sequential, serial_sequential = compiled(tnt.Sequential(stack())), compiled(keras.Sequential(stack()))
    history = sequential.fit(dataset(x, y, 32), epochs=2, verbose=0).history
    serial_history = serial_sequential.fit(dataset(x, y, 32), epochs=2, verbose=0).history
    result["sequential"] = [type(sequential).__name__, type(sequential.model).__name__,
                            type(tnt.Sequential.from_config(sequential.get_config())).__name__]
    result["sequential_vs_serial"] = [weights_difference(sequential, serial_sequential), history, serial_history]
    return result


def failed_save(out):
    """A write that fails midway: the old file stays, nothing partial remains, every rank raises."""
    _, model = pair()
    x, y = arrays()
    model.fit(dataset(x, y, 32), epochs=1, verbose=0)
    folder = os.path.join(out, "shared")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "model.weights.h5")
    model.save_weights(target)
    before = open(target, "rb").read()

    def broken_write(path, *args, **kwargs):
        with open(path, "wb") as partial:
            partial.write(b"half a file")
        raise OSError("disk full (simulated)")

    model._keras_model.save_weights = broken_write
    try:
        model.save_weights(target)
        error = None
    except OSError as raised:
        error = str(raised)
    return {"error": error, "unchanged": open(target, "rb").read() == before,
            "files": sorted(os.listdir(folder))}


def batch_options(out):
    """tnt_micro_batch_size, tnt_validation_micro_batch_size, NumPy, dicts, PyDataset."""
    size = tnt.get_size()
    micro = 16
    x, y = arrays()
    val_x, val_y = arrays(40, seed=1)
    results = {}

    serial, model = pair()
    expected = serial.fit(dataset(x, y, micro * size), validation_data=dataset(val_x, val_y, 8 * size),
                          epochs=2, verbose=0)
    unbatched = tf.data.Dataset.from_tensor_slices((x, y))
    got = model.fit(unbatched, validation_data=tf.data.Dataset.from_tensor_slices((val_x, val_y)), epochs=2,
                    verbose=0, tnt_micro_batch_size=micro, tnt_validation_micro_batch_size=8)
    results["micro_batch_fit"] = [weights_difference(model, serial), got.history, expected.history]
    results["micro_batch_batched"] = model.evaluate(dataset(x, y, micro * size), verbose=0,
                                                    tnt_micro_batch_size=micro)
    results["micro_batch_evaluate"] = [model.evaluate(unbatched, verbose=0, tnt_micro_batch_size=micro),
                                       serial.evaluate(dataset(x, y, micro * size), verbose=0)]
    predicted = model.predict(tf.data.Dataset.from_tensor_slices(x), verbose=0, tnt_micro_batch_size=micro)
    results["micro_batch_predict"] = float(np.max(np.abs(predicted - serial.predict(x, verbose=0))))
    try:
        model.fit(dataset(x, y, 50), verbose=0, tnt_micro_batch_size=micro)
        results["inconsistent_error"] = None
    except ValueError as error:
        results["inconsistent_error"] = str(error)

    # Serial Keras and tnt.Model train one after the other in this process: each fit starts from the
    # same seeded generators, as in a program of its own (fit's default shuffle draws from them).
    serial, model = pair()
    keras.utils.set_random_seed(5)
    expected = serial.fit(x, y, batch_size=32, epochs=2, validation_split=0.2, verbose=0)
    keras.utils.set_random_seed(5)
    got = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.2, verbose=0)
    results["numpy_fit"] = [weights_difference(model, serial), got.history, expected.history]
    results["numpy_evaluate"] = [model.evaluate(x, y, batch_size=50, verbose=0),
                                 serial.evaluate(x, y, batch_size=50, verbose=0)]
    results["numpy_predict"] = float(np.max(np.abs(model.predict(x, batch_size=40, verbose=0) -
                                                   serial.predict(x, batch_size=40, verbose=0))))

    def dict_model():
        keras.utils.set_random_seed(3)
        inputs = {"a": keras.Input((5,), name="a"), "b": keras.Input((3,), name="b")}
        merged = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
        return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(merged))

    features = {"a": x[:, :5], "b": x[:, 5:]}
    serial, model = compiled(dict_model()), compiled(tnt.Model(dict_model()))
    keras.utils.set_random_seed(5)
    serial.fit(features, y, batch_size=27, epochs=2, verbose=0)
    keras.utils.set_random_seed(5)
    model.fit(features, y, batch_size=27, epochs=2, verbose=0)
    results["dict_fit"] = weights_difference(model, serial)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            rows = slice(index * 30, min(index * 30 + 30, SAMPLES))
            return x[rows], y[rows]

    serial, model = pair()
    keras.utils.set_random_seed(5)
    expected = serial.fit(Batches(), epochs=2, verbose=0)
    keras.utils.set_random_seed(5)
    got = model.fit(Batches(), epochs=2, verbose=0)
    results["pydataset_fit"] = [weights_difference(model, serial), got.history, expected.history]
    results["pydataset_evaluate"] = [model.evaluate(Batches(), verbose=0), serial.evaluate(Batches(), verbose=0)]
    results["pydataset_predict"] = float(np.max(np.abs(model.predict(Batches(), verbose=0) -
                                                       serial.predict(Batches(), verbose=0))))
    return results


def manual_sharding(out):
    """Each rank passes its own shard, batched with the micro-batch size."""
    rank, size = tnt.get_rank(), tnt.get_size()
    x, y = arrays(128)
    serial, model = pair()
    serial.fit(dataset(x, y, 32), epochs=2, verbose=0)
    shard = tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank).batch(32 // size)
    model.fit(shard, validation_data=shard, epochs=2, verbose=0, tnt_distribute_dataset=False,
              tnt_distribute_validation_dataset=False)
    return {"weights_difference": weights_difference(model, serial)}


def manual_sharding_uneven(out):
    rank, size = tnt.get_rank(), tnt.get_size()
    x, y = arrays(128)
    _, model = pair()
    uneven = tf.data.Dataset.from_tensor_slices((x, y)).take(96 + 32 * rank).batch(32)
    model.fit(uneven, epochs=1, verbose=0, tnt_distribute_dataset=False)
    return {}


def batch_normalization_warning(out):
    x, y = arrays()
    model = compiled(tnt.Model(build(batch_normalization=True)))
    model.fit(dataset(x, y, 16), epochs=1, verbose=0)
    model.fit(dataset(x, y, 16), epochs=1, verbose=0)
    large = compiled(tnt.Model(build(batch_normalization=True)))
    large.fit(dataset(x, y, 32 * tnt.get_size()), epochs=1, verbose=0)
    return {}


def shared_layers(out):
    """The manual's pattern: train a tnt.Model, predict with a serial model built from its layers."""
    x, y = arrays()

    def models():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((FEATURES,))
        body = keras.layers.Dense(16, activation="relu")
        head = keras.layers.Dense(CLASSES, activation="softmax")
        features = body(inputs)
        inference = keras.Model(inputs, features)
        return compiled(keras.Model(inputs, head(features))), inference

    serial_training, serial_inference = models()
    serial_training.fit(dataset(x, y, 32), epochs=2, verbose=0)
    training, inference = models()
    compiled(tnt.Model(training)).fit(dataset(x, y, 32), epochs=2, verbose=0)
    return {"difference": float(np.max(np.abs(inference.predict(x, verbose=0) -
                                              serial_inference.predict(x, verbose=0))))}


def background_checkpoints(out):
    """ModelCheckpoint wrapped with write_in_background=True, a file per epoch, next to serial Keras'
    plain ModelCheckpoint; with a third argument, the checkpoints go to that folder (a full disk)."""
    x, y = arrays()
    epochs = 4

    def checkpoint(folder):
        return keras.callbacks.ModelCheckpoint(os.path.join(folder, "epoch{epoch}.keras"))

    serial = compiled(build(), learning_rate=0.01, optimizer="adam")
    model = compiled(tnt.Model(build()), learning_rate=0.01, optimizer="adam")
    serial_folder = os.path.join(out, f"serial{tnt.get_rank()}")  # each rank's own: writes to one file would mix
    os.makedirs(serial_folder, exist_ok=True)
    serial.fit(dataset(x, y, 32), epochs=epochs, verbose=0, callbacks=[checkpoint(serial_folder)])
    folder = sys.argv[3] if len(sys.argv) > 3 else own_folder(out)
    model.fit(dataset(x, y, 32), epochs=epochs, verbose=0,
              callbacks=[tnt.keras.callbacks.Callback(checkpoint(folder), write_in_background=True)])
    differences = []
    for epoch in range(1, epochs + 1):
        saved = keras.models.load_model(os.path.join(out, "rank0", f"epoch{epoch}.keras"))
        expected = keras.models.load_model(os.path.join(serial_folder, f"epoch{epoch}.keras"))
        pairs = list(zip(saved.get_weights(), expected.get_weights()))
        pairs += [(a.numpy(), b.numpy()) for a, b in zip(saved.optimizer.variables, expected.optimizer.variables)]
        differences.append(max(float(np.max(np.abs(a - b))) for a, b in pairs))
    return {"differences": differences, "iterations": int(saved.optimizer.iterations.numpy()),
            "staged": os.listdir(os.environ["TMPDIR"])}


def background_copy(out):
    """A save made in the background returns while its copy into place is held up; the file appears,
    whole, once the copy may go on."""
    import threading

    from tarantella import saving

    release, copy = threading.Event(), saving.shutil.copyfile
    saving.shutil.copyfile = lambda source, target: (release.wait(30), copy(source, target))[1]
    target = os.path.join(own_folder(out), "model.weights.h5")
    with saving.master_alone(in_background=True):
        saving.write_whole(target, lambda path: open(path, "wb").write(b"the whole file"))
    there_before = os.path.exists(target)
    release.set()
    saving.wait_for_background_write()
    return {"there_before_the_copy": there_before, "contents": open(target, "rb").read().decode(),
            "files": sorted(os.listdir(os.path.dirname(target)))}


class Subclassed(keras.Model):
    """A model of the user's own class: saved in the background, Keras writes it on the step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.classes = keras.layers.Dense(CLASSES, activation="softmax")

    def call(self, inputs):
        return self.classes(self.hidden(inputs))


def background_snapshot(out):
    """A save made in the background holds the model as it was when saved, though the model trains
    on before the save's thread writes: a Functional model is written by that thread (held up here
    until training went on), a subclassed one by Keras on the step, then copied by the thread."""
    import threading

    from tarantella import saving

    x, y = arrays()
    release, writers = threading.Event(), []
    save_weights = keras.Model.save_weights

    def held_up_off_the_main_thread(model, path, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            writers.append(type(model).__name__)
            release.wait(60)
        return save_weights(model, path, *args, **kwargs)

    keras.Model.save_weights = held_up_off_the_main_thread
    results = {}
    for kind, make in (("functional", build), ("subclassed", Subclassed)):
        model = compiled(tnt.Model(make()), learning_rate=0.01, optimizer="adam")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        state = lambda m: [np.array(v) for v in [*m.get_weights(), *m.optimizer.variables]]  # noqa: E731
        at_save = state(model)
        target = os.path.join(own_folder(out), f"{kind}.weights.h5")
        release.clear()
        with saving.master_alone(in_background=True):
            model.save_weights(target)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # while the thread may still write
        release.set()
        saving.wait_for_background_write()
        check = compiled(make(), learning_rate=0.01, optimizer="adam")
        check(x[:1])
        check.optimizer.build(check.trainable_variables)
        check.load_weights(target)
        saved = state(check)
        results[kind] = {
            "difference_to_the_state_at_save": max(float(np.max(np.abs(a - b))) for a, b in zip(saved, at_save)),
            "difference_to_the_weights_after": max(float(np.max(np.abs(a - b)))
                                                   for a, b in zip(check.get_weights(), model.get_weights())),
            "variables": len(saved)}
    results["written_by_a_thread"] = writers
    return results


SCENARIOS = {function.__name__: function for function in (
    deciding_callbacks, terminate_on_nan, writing_callbacks, custom_callbacks, wrapper_errors,
    backup_and_restore, save_and_resume, configs_and_weights, failed_save, batch_options, manual_sharding,
    manual_sharding_uneven, batch_normalization_warning, shared_layers, background_checkpoints,
    background_copy, background_snapshot)}


def main():
    name, out = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](out)
    with open(os.path.join(out, f"{name}.rank{tnt.get_rank()}.json"), "w") as file:
        json.dump(result, file, default=lambda value: np.asarray(value).tolist())


if __name__ == "__main__":
    main()
