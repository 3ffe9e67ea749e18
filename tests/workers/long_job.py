"""A small training job for the restart tests: `long_job.py OUT [--input KIND] [--fits N] ...`.

It trains an MLP (two hidden layers) with Dropout (a random seed state to restore; `--no-dropout` leaves it out) and Adam on 200 samples in
batches of 32 (7 steps per epoch, the last one uneven) and saves the master's final weights
and history to OUT/weights.npz. The input is one of: `arrays` (shuffle=True), `dataset` (a
reshuffling tf.data shuffle), `pydataset` (a shuffled keras.utils.PyDataset), `files`
(TFRecord files, made first with `--make-files`). With `--fits 2` it trains two models one
after the other (each its own `fit` call). With `--serial` it runs plain Keras, without
tarantella: the reference a resumed job must end at.

Faults come from the environment, so the same command fails on one attempt only:
FAULT="attempt=0,rank=1,fit=1,epoch=1,step=3,how=raise" makes rank 1 of attempt 0 fail
before step 3 (0-based) of epoch 1 (0-based) of the first fit call (several faults: separated
by ";"); `how` is raise, kill
(SIGKILL to itself), exit (os._exit(0), a rank that vanishes) or startup (raise before
`import tarantella`, with no epoch or step). STEP_SLEEP=s sleeps s seconds after every step
(to give an outside killer time). Rank 0 prints `fit K trained N steps` for every fit call, and
with ANNOUNCE_STEPS=1 `fit K epoch E step S done` after every step (0-based).
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES, FEATURES, CLASSES, BATCH = 200, 8, 3, 32


def fault():
    """This rank's planned failure in this attempt, or None."""
    attempt = os.environ.get("TNT_RESTART_ATTEMPT", "0")
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    for planned in filter(None, os.environ.get("FAULT", "").split(";")):
        spec = dict(item.split("=") for item in planned.split(","))
        if spec["attempt"] == attempt and spec["rank"] == rank:
            return spec
    return None


def fail(how):
    sys.stderr.write(f"long_job: failing now ({how})\n")
    sys.stderr.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        os._exit(0)
    raise RuntimeError("injected fault")


def samples():
    import numpy as np
    generator = np.random.default_rng(7)
    x = generator.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    return x, y


def make_files(folder):
    import tensorflow as tf
    x, y = samples()
    os.makedirs(folder, exist_ok=True)
    for part in range(3):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part-{part}.tfrecord")) as writer:
            for index in range(part, SAMPLES, 3):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[index])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[index]]))}))
                writer.write(example.SerializeToString())


def fit_input(kind, files):
    import keras
    import numpy as np
    import tensorflow as tf
    x, y = samples()
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=BATCH, shuffle=True)
    if kind == "dataset":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=3, reshuffle_each_iteration=True)
        return dict(x=dataset.batch(BATCH))
    if kind == "pydataset":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return -(-SAMPLES // BATCH)

            def __getitem__(self, index):
                return x[index * BATCH:(index + 1) * BATCH], y[index * BATCH:(index + 1) * BATCH]
        return dict(x=Batches(), shuffle=True)
    if kind == "files":
        spec = {"x": tf.io.FixedLenFeature([FEATURES], tf.float32), "y": tf.io.FixedLenFeature([1], tf.int64)}

        def parse(record):
            parsed = tf.io.parse_single_example(record, spec)
            return parsed["x"], parsed["y"][0]
        names = sorted(os.path.join(files, name) for name in os.listdir(files))
        dataset = tf.data.TFRecordDataset(names).map(parse).shuffle(64, seed=5)
        return dict(x=dataset.batch(BATCH))
    raise ValueError(kind)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--input", default="arrays")
    parser.add_argument("--fits", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--files", default=None)
    parser.add_argument("--make-files", action="store_true")
    parser.add_argument("--width", type=int, default=32, help="units of each of the two hidden layers")
    parser.add_argument("--no-dropout", dest="dropout", action="store_false",
                        help="no Dropout: its masks depend on the number of ranks")
    parser.add_argument("--serial", action="store_true", help="plain Keras, without tarantella: the reference")
    options = parser.parse_args()
    if options.make_files:
        make_files(options.out)
        return
    planned = fault()
    if planned and planned["how"] == "startup":
        fail("startup")

    import keras
    import numpy as np
    if options.serial:
        wrap, is_master = (lambda model: model), True
    else:
        import tarantella as tnt
        wrap, is_master = tnt.Model, tnt.is_master_rank()

    step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
    announce_steps = os.environ.get("ANNOUNCE_STEPS") == "1" and is_master

    class Faults(keras.callbacks.Callback):
        def __init__(self, fit_number):
            super().__init__()
            self.fit_number, self.epoch, self.trained = fit_number, 0, 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if planned and int(planned["fit"]) == self.fit_number and int(planned["epoch"]) == self.epoch \
                    and int(planned["step"]) == batch:
                fail(planned["how"])

        def on_train_batch_end(self, batch, logs=None):
            self.trained += 1
            if announce_steps:
                print(f"fit {self.fit_number} epoch {self.epoch} step {batch} done", flush=True)
            if step_sleep:
                time.sleep(step_sleep)

    results = {}
    for fit_number in range(1, options.fits + 1):
        keras.utils.set_random_seed(fit_number)
        model = wrap(keras.Sequential([
            keras.Input((FEATURES,)), keras.layers.Dense(options.width, activation="relu"),
            keras.layers.Dense(options.width, activation="relu"),
            *([keras.layers.Dropout(0.2, seed=11)] if options.dropout else []),
            keras.layers.Dense(CLASSES, activation="softmax")]))
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
        faults = Faults(fit_number)
        history = model.fit(**fit_input(options.input, options.files), epochs=options.epochs, verbose=0,
                            callbacks=[faults])
        if is_master:
            print(f"fit {fit_number} trained {faults.trained} steps", flush=True)
        for index, weight in enumerate(model.get_weights()):
            results[f"fit{fit_number}_weight{index}"] = weight
        for key, values in history.history.items():
            results[f"fit{fit_number}_history_{key}"] = np.array(values)
    if is_master:
        np.savez(os.path.join(options.out, "weights.npz"), **results)


if __name__ == "__main__":
    main()
