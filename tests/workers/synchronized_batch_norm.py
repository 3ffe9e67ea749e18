"""Synchronized BatchNormalization on Keras' JAX and torch backends (KERAS_BACKEND picks).

`--mode serial` trains a small conv net with plain BatchNormalization on one process (there the
batch is the global batch), `--mode tnt` the same net as
tnt.Model(model, synchronized_batch_normalization=True); each saves one file per case and rank
(weights with the moving mean and variance, History, evaluate, predictions) for the test to
compare (`--serial-out` runs the serial reference in the ranks' processes first, with plain Keras:
one launch instead of two processes, for the quick case). Global batch 10 of 61 samples: micro-batches 5/5 on 2 ranks, 4/3/3 on 3 ranks, and a
last global batch of 1 sample that leaves the other ranks without samples.

`sync-bn-saved`: the conv net trained for an epoch and saved (`tnt` with tnt.Model.save, from a
tnt.Model(model, synchronized_batch_normalization=True)), read back with keras.models.load_model,
and trained for one more epoch: by tnt.models.load_model(..., synchronized_batch_normalization=True)
on the ranks, by the Keras model serially. `--mode serial --train-on-saved FILE OUT` then also
trains on the file a tnt run saved, read with keras.models.load_model in this process without
tarantella, and saves the results in OUT.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES = 61


def data(np):
    rng = np.random.default_rng(3)
    # Offsets and scales far from 0 and 1: the moments matter.
    features = (rng.normal(size=(SAMPLES, 6, 6, 2)) * [2.0, 0.5] + [1.5, -3.0]).astype("float32")
    return features, rng.integers(0, 3, SAMPLES)


def model_for(keras, name):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6, 6, 2))
    if name == "sync-bn-quick":  # one layer, one epoch: the quick case
        hidden = keras.layers.Dense(6, use_bias=False)(keras.layers.Flatten()(inputs))
        hidden = keras.layers.BatchNormalization(momentum=0.5)(hidden)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    hidden = keras.layers.Conv2D(4, 3, use_bias=False)(inputs)
    hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization(momentum=0.8)(hidden))
    if name == "sync-bn-dense":
        # No bias before BatchNormalization: its gradient would be rounding noise, which Adam
        # turns into steps of the learning rate.
        hidden = keras.layers.Dense(8, use_bias=False)(keras.layers.Flatten()(hidden))
        hidden = keras.layers.BatchNormalization(momentum=0.5, center=False)(hidden)
    else:
        hidden = keras.layers.Dense(8)(keras.layers.Flatten()(hidden))
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    return keras.Model(inputs, outputs)


CASES = ["sync-bn-conv", "sync-bn-dense", "sync-bn-quick"]


def run_case(name, mode, out_dir, serial_dir=None):
    """`serial_dir` (tnt mode): first train the serial reference in this process, with plain Keras
    (no collective), and save it there on rank 0: one launch instead of two processes."""
    import keras
    import numpy as np

    if serial_dir is not None:
        import tarantella as tnt
        run_case(name, "serial", serial_dir if tnt.get_rank() == 0 else None)
    model = model_for(keras, name)
    rank = 0
    if mode == "tnt":
        import tarantella as tnt
        model = tnt.Model(model, synchronized_batch_normalization=True)
        rank = tnt.get_rank()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9) if name == "sync-bn-conv" else keras.optimizers.Adam(0.01)
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
    features, labels = data(np)
    quick = name == "sync-bn-quick"
    history = model.fit(features, labels, batch_size=10, epochs=1 if quick else 2, verbose=0,
                        validation_data=None if quick else (features[:23], labels[:23]))
    arrays = {"evaluation": np.array(model.evaluate(features, labels, batch_size=10, verbose=0)),
              "predictions": model.predict(features, batch_size=10, verbose=0)}
    arrays.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    if out_dir is not None:
        np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **arrays)


SAVED_CASE = "sync-bn-saved"


def run_saved_case(mode, out_dir, tnt_file=None, tnt_file_out=None):
    """`tnt_file` (serial mode): afterwards, also train on the file a tnt run saved, results in `tnt_file_out`."""
    import keras
    import numpy as np

    tnt, rank = None, 0
    if mode == "tnt":
        import tarantella as tnt
        rank = tnt.get_rank()
    model = model_for(keras, "sync-bn-conv")
    if tnt:
        model = tnt.Model(model, synchronized_batch_normalization=True)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    features, labels = data(np)
    model.fit(features, labels, batch_size=10, epochs=1, verbose=0)
    saved = os.path.join(out_dir, f"{SAVED_CASE}.keras")
    model.save(saved)
    loaded = tnt.models.load_model(saved, synchronized_batch_normalization=True) if tnt else None
    train_on_saved(keras, np, saved, loaded, os.path.join(out_dir, f"{SAVED_CASE}.rank{rank}.npz"))
    if tnt_file is not None:
        train_on_saved(keras, np, tnt_file, None, os.path.join(tnt_file_out, f"{SAVED_CASE}.rank0.npz"))


def train_on_saved(keras, np, saved, model, results_file):
    """Reads `saved` with keras.models.load_model, then trains `model` (where None, the model read) for
    one more epoch, and saves both models' weights, the History, evaluate and predict."""
    read = keras.models.load_model(saved)
    arrays = {f"weight_loaded_by_keras_{i}": w for i, w in enumerate(read.get_weights())}
    model = model or read
    features, labels = data(np)
    keras.utils.set_random_seed(8)  # the second epoch's shuffle, alike in a process that trained none
    history = model.fit(features, labels, batch_size=10, epochs=1, verbose=0)
    arrays.update({"evaluation": np.array(model.evaluate(features, labels, batch_size=10, verbose=0)),
                   "predictions": model.predict(features, batch_size=10, verbose=0)})
    arrays.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    np.savez(results_file, **arrays)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--serial-out", help="tnt mode: also train serially in this process, saved here")
    parser.add_argument("--train-on-saved", nargs=2, metavar=("FILE", "OUT"), default=(None, None),
                        help=f"serial mode, {SAVED_CASE}: also train on the file a tnt run saved")
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before Keras runs, as users should)
    for name in args.cases.split(","):
        if name == SAVED_CASE:
            run_saved_case(args.mode, args.out, *args.train_on_saved)
        else:
            run_case(name, args.mode, args.out, args.serial_out)


if __name__ == "__main__":
    sys.exit(main())
