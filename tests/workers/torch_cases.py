"""Keras' PyTorch backend: inputs only torch has, and the features tnt.Model refuses there.

`--mode serial` trains with plain Keras-on-torch, `--mode tnt` with tnt.Model; each saves one
file per case and rank for the test to compare. `--refuse FEATURE` runs one feature that the
torch step does not have yet, which must raise a clear error on every rank, before any collective.
"""

import argparse
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

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


def run_case(name, mode, out_dir):
    import keras
    import numpy as np
    import torch

    keras.utils.set_random_seed(11)
    model = mlp(keras)
    if mode == "tnt":
        import tarantella as tnt
        model = tnt.Model(model)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    arrays = {}
    if name.startswith("data-loader"):  # global batch 71: uneven micro-batches on 2 and 3 ranks
        shuffled = name == "data-loader-shuffled"
        history = model.fit(data_loader(np, torch, 71, shuffle=shuffled), epochs=3, verbose=0)
        arrays["evaluation"] = np.array(model.evaluate(data_loader(np, torch, 71, shuffle=False), verbose=0))
        arrays["predictions"] = model.predict(data_loader(np, torch, 71, shuffle=False), verbose=0)
    elif name == "numpy-batch2":  # the last global batch of 1 sample leaves the other ranks empty
        features, labels = data(np)
        history = model.fit(features[:9], labels[:9], batch_size=2, epochs=2, shuffle=False, verbose=0,
                            validation_data=(features[9:20], labels[9:20]))
        arrays["evaluation"] = np.array(model.evaluate(features, labels, batch_size=7, verbose=0))
        arrays["predictions"] = model.predict(features, batch_size=7, verbose=0)
    rank = tnt.get_rank() if mode == "tnt" else 0
    arrays.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **arrays)


CASES = ["data-loader", "data-loader-shuffled", "numpy-batch2"]


def refuse(feature):
    import keras
    import numpy as np
    import torch

    import tarantella as tnt

    class OwnTrainStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    features, labels = data(np)
    try:
        if feature == "custom_train_step":
            tnt.Model(OwnTrainStep([keras.Input((8,)), keras.layers.Dense(3)]))
        elif feature == "synchronized_batch_normalization":
            tnt.Model(keras.Sequential([keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)]),
                      synchronized_batch_normalization=True)
        elif feature == "tnt_optimizers":
            tnt.optimizers.Optimizer(keras.optimizers.SGD())
        elif feature == "collective_on_tensor":
            tnt.allreduce(torch.ones(3))
        elif feature in ("masked_loss", "summed_loss"):
            model = tnt.Model(mlp(keras))
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
                **({"ignore_class": 0} if feature == "masked_loss" else {"reduction": "sum"})))
            model.fit(features, labels, batch_size=8, verbose=0)
        elif feature == "local_logs":
            model = tnt.Model(mlp(keras))
            model.compile("sgd", "sparse_categorical_crossentropy")
            model.fit(features, labels, batch_size=8, verbose=0,
                      callbacks=[tnt.keras.callbacks.Callback(keras.callbacks.Callback(), aggregate_logs=False)])
    except NotImplementedError as refusal:
        print(f"rank {tnt.get_rank()} refused: {refusal}", flush=True)
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
