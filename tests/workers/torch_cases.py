"""Keras' PyTorch backend: inputs only torch has, and the features tnt.Model refuses there.

`--mode serial` trains with plain Keras-on-torch, `--mode tnt` with tnt.Model; each saves one
file per case and rank for the test to compare (the synchronized BatchNormalization cases come
from synchronized_batch_norm.py). `--refuse FEATURE` runs one feature that the
torch step does not have yet, which must raise a clear error on every rank, before any collective.
"""

import argparse
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import synchronized_batch_norm  # noqa: E402  (tests/workers: synchronized BatchNormalization)

SAMPLES = 135


def mlp(keras):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def data(np):
    rng = np.random.default_rng(0)
    return rng.normal(size=(SAMPLES, 8)).astype("float32"), rng.integers(0, 3, SAMPLES)


def data_loader(np, torch, batch_size, shuffle):
    features, labels = data(np)
    samples = torch.utils.data.TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))
    return torch.utils.data.DataLoader(samples, batch_size=batch_size, shuffle=shuffle)


def sequences(np):
    """Token sequences padded with zeros, and a label per token."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 20, (SAMPLES, 6))
    lengths = rng.integers(1, 7, SAMPLES)
    tokens[np.arange(6) >= lengths[:, None]] = 0
    return tokens, rng.integers(0, 3, (SAMPLES, 6))


def masked_sequence_model(keras):
    """The Embedding's mask (mask_zero=True) passes the Dense layer and reaches the loss."""
    inputs = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(embedded))


# Losses that Keras does not divide by the micro-batch's number of entries.
LOSS_CASES = {
    "ignore-class": {"ignore_class": 0},
    "mask-zero": {},
    "summed-loss": {"reduction": "sum"},
    "weighted-mean": {"reduction": "mean_with_sample_weight"},
    "sample-weights": {},
}


def run_loss_case(name, model, keras, np):
    """fit, evaluate and predict with global batch 71 (uneven micro-batches on 2 and 3 ranks)."""
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(**LOSS_CASES[name]), metrics=["sparse_categorical_accuracy"])
    features, labels = sequences(np) if name == "mask-zero" else data(np)
    weights = None
    if name in ("weighted-mean", "sample-weights"):
        weights = np.random.default_rng(2).uniform(0.0, 2.0, SAMPLES).astype("float32")
    history = model.fit(features, labels, sample_weight=weights, batch_size=71, epochs=3, verbose=0,
                        validation_data=(features[:40], labels[:40]))
    evaluation = model.evaluate(features, labels, sample_weight=weights, batch_size=71, verbose=0)
    return history, {"evaluation": np.array(evaluation), "predictions": model.predict(features, batch_size=71,
                                                                                       verbose=0)}


def run_api_case(name, model, keras, np, out_dir, load_model):
    """train_on_batch/test_on_batch, saving and loading, ModelCheckpoint and EarlyStopping."""
    features, labels = data(np)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    arrays = {}
    if name == "on-batch":  # one global batch of 71 given to every rank
        for step in range(3):
            rows = slice(step * 40, step * 40 + 71)
            logs = model.train_on_batch(features[rows], labels[rows], return_dict=True)
            arrays[f"train_on_batch_{step}"] = np.array([logs[key] for key in sorted(logs)])
        logs = model.test_on_batch(features[:71], labels[:71], return_dict=True)
        arrays["test_on_batch"] = np.array([logs[key] for key in sorted(logs)])
        arrays["predictions"] = np.asarray(model.predict_on_batch(features[:71]))
        return {}, arrays
    if name == "save-load":
        history = model.fit(features, labels, batch_size=71, epochs=2, verbose=0)
        model.save(os.path.join(out_dir, "save-load.keras"))
        model.save_weights(os.path.join(out_dir, "save-load.weights.h5"))
        loaded = load_model(os.path.join(out_dir, "save-load.keras"))
        reloaded = mlp(keras)
        reloaded.load_weights(os.path.join(out_dir, "save-load.weights.h5"))
        # The loaded model goes on training with the saved optimizer state.
        loaded.fit(features, labels, batch_size=71, epochs=1, verbose=0)
        arrays.update({f"weight_reloaded_{i}": w for i, w in enumerate(reloaded.get_weights())})
        arrays.update({f"weight_loaded_then_trained_{i}": w for i, w in enumerate(loaded.get_weights())})
        return history.history, arrays
    # callbacks: val_loss stops improving by 0.02 within a few epochs; the best model is kept.
    checkpoint = os.path.join(out_dir, "callbacks-best.keras")
    history = model.fit(features, labels, batch_size=71, epochs=20, verbose=0,
                        validation_data=(features[:50], labels[:50]), callbacks=[
                            keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.02, patience=1),
                            keras.callbacks.ModelCheckpoint(checkpoint, monitor="val_loss", save_best_only=True)])
    arrays.update({f"weight_best_{i}": w for i, w in enumerate(load_model(checkpoint).get_weights())})
    return history.history, arrays


API_CASES = ["on-batch", "save-load", "callbacks"]


def run_case(name, mode, out_dir):
    import keras
    import numpy as np
    import torch

    if name in synchronized_batch_norm.CASES:  # a conv net; global batch 10 of 61 samples
        return synchronized_batch_norm.run_case(name, mode, out_dir)
    keras.utils.set_random_seed(11)
    model = masked_sequence_model(keras) if name == "mask-zero" else mlp(keras)
    if mode == "tnt":
        import tarantella as tnt
        model = tnt.Model(model)
    rank = tnt.get_rank() if mode == "tnt" else 0
    if name in LOSS_CASES:
        history, arrays = run_loss_case(name, model, keras, np)
        save(name, rank, model, history.history, arrays, out_dir)
        return
    if name in API_CASES:
        load_model = tnt.models.load_model if mode == "tnt" else keras.models.load_model
        history, arrays = run_api_case(name, model, keras, np, out_dir, load_model)
        save(name, rank, model, history, arrays, out_dir)
        return
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    arrays = {}
    if name.startswith("data-loader"):  # global batch 71: uneven micro-batches on 2 and 3 ranks
        shuffled = name == "data-loader-shuffled"
        # A validation pass between epochs draws from torch's generator too (the DataLoader's base seed).
        validation = data_loader(np, torch, 40, shuffle=False) if shuffled else None
        history = model.fit(data_loader(np, torch, 71, shuffle=shuffled), epochs=3, verbose=0,
                            validation_data=validation)
        arrays["evaluation"] = np.array(model.evaluate(data_loader(np, torch, 71, shuffle=False), verbose=0))
        arrays["predictions"] = model.predict(data_loader(np, torch, 71, shuffle=False), verbose=0)
    elif name == "numpy-batch2":  # the last global batch of 1 sample leaves the other ranks empty
        features, labels = data(np)
        history = model.fit(features[:9], labels[:9], batch_size=2, epochs=2, verbose=0,
                            validation_data=(features[9:20], labels[9:20]))
        arrays["evaluation"] = np.array(model.evaluate(features, labels, batch_size=7, verbose=0))
        arrays["predictions"] = model.predict(features, batch_size=7, verbose=0)
    save(name, rank, model, history.history, arrays, out_dir)


def save(name, rank, model, history, arrays, out_dir):
    import numpy as np

    arrays.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    arrays.update({f"history_{key}": np.array(values) for key, values in history.items()})
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **arrays)


CASES = ["data-loader", "data-loader-shuffled", "numpy-batch2", *LOSS_CASES, *API_CASES,
         *synchronized_batch_norm.CASES]


def refuse(feature):
    import keras
    import numpy as np

    import tarantella as tnt

    class OwnTrainStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    features, labels = data(np)
    try:
        if feature == "synchronized_moments_in_custom_step":
            model = tnt.Model(OwnTrainStep([keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)]),
                              synchronized_batch_normalization=True)
            model.compile("sgd", "sparse_categorical_crossentropy")
            model.fit(features, labels, batch_size=8, verbose=0)
        elif feature == "local_logs":
            model = tnt.Model(mlp(keras))
            model.compile("sgd", "sparse_categorical_crossentropy")
            model.fit(features, labels, batch_size=8, verbose=0,
                      callbacks=[tnt.keras.callbacks.Callback(keras.callbacks.Callback(), aggregate_logs=False)])
    except NotImplementedError as refusal:
        print(f"rank {tnt.get_rank()} refused: {' '.join(str(refusal).split())}", flush=True)  # Keras may wrap it over lines
        sys.exit(3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"])
    parser.add_argument("--out")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--refuse")
    args = parser.parse_args()
    if args.refuse:
        return refuse(args.refuse)
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before Keras runs, as users should)
    for name in args.cases.split(","):
        run_case(name, args.mode, args.out)


if __name__ == "__main__":
    sys.exit(main())
