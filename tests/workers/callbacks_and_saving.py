"""Callbacks, saving and loading, and PyDataset input, serially and under tarantella.

`callbacks_and_saving.py --mode serial|tnt --out OUT` trains one MLP on a keras.utils.PyDataset
(shuffled by fit, as by default) with ModelCheckpoint, EarlyStopping (which stops the fit before its last epoch), a
LearningRateScheduler and History, then saves it with `save` and `save_weights` and loads both
files back (`tnt.models.load_model` under tarantella). Each rank writes OUT/rank{R}/results.npz
with the weights, History, the epochs the checkpoint wrote, the loaded models' weights and the
loaded model's evaluation; checkpoints go to OUT/rank{R}/checkpoints, which only the master's
ModelCheckpoint writes to, and the model files to OUT/model.keras and OUT/model.weights.h5.
Run with KERAS_BACKEND=jax by tests/test_jax_backend.py.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES, BATCH = 135, 32


def build(keras):
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import keras
    import numpy as np

    rank, wrap, load_model = 0, (lambda model: model), keras.models.load_model
    if args.mode == "tnt":
        import tarantella as tnt
        rank, wrap, load_model = tnt.get_rank(), tnt.Model, tnt.models.load_model
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-SAMPLES // BATCH)

        def __getitem__(self, index):
            return x[index * BATCH:(index + 1) * BATCH], y[index * BATCH:(index + 1) * BATCH]

    keras.utils.set_random_seed(5)
    model = wrap(build(keras))
    model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy", metrics=["accuracy"])
    own = os.path.join(args.out, f"rank{rank}")
    checkpoints = os.path.join(own, "checkpoints")
    os.makedirs(checkpoints)
    callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "epoch{epoch}.weights.h5"),
                                                 save_weights_only=True),
                 keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.02, patience=0),
                 keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.7)]
    history = model.fit(Batches(), epochs=30, validation_data=(x, y), callbacks=callbacks, verbose=0)
    model_file, weights_file = os.path.join(args.out, "model.keras"), os.path.join(args.out, "model.weights.h5")
    model.save(model_file)
    model.save_weights(weights_file)
    loaded = load_model(model_file)
    fresh = wrap(build(keras))
    fresh.load_weights(weights_file)
    written = sorted(int(name[len("epoch"):-len(".weights.h5")]) for name in os.listdir(checkpoints))
    last_checkpoint = build(keras)
    if written:
        last_checkpoint.load_weights(os.path.join(checkpoints, f"epoch{written[-1]}.weights.h5"))
    results = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    results.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    results.update({f"loaded_weight_{i}": w for i, w in enumerate(loaded.get_weights())})
    results.update({f"loaded_weights_file_{i}": w for i, w in enumerate(fresh.get_weights())})
    if written:
        results.update({f"checkpoint_weight_{i}": w for i, w in enumerate(last_checkpoint.get_weights())})
    results["checkpoint_epochs"] = np.array(written)
    results["loaded_evaluation"] = np.array(loaded.evaluate(x, y, batch_size=BATCH, verbose=0))
    np.savez(os.path.join(own, "results.npz"), **results)


if __name__ == "__main__":
    main()
