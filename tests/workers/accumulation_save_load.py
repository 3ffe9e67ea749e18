"""Gradient accumulation across fits: a fit that ends inside an accumulation cycle, a save, a load,
and a fit that goes on from there. `--mode serial` uses plain Keras, `--mode tnt` tnt.Model; each
saves the final weights (every rank) and the optimizer's accumulators (the master, or serially)."""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella as tnt
    import keras
    import numpy as np

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    # Global batches of 5 (2/2/1 on 3 ranks), the last of 1 (1/0/0): 13 micro-steps per epoch.
    x, y = rng.normal(size=(61, 8)).astype("float32"), rng.integers(0, 3, 61)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(
        keras.layers.Dense(16, activation="relu")(inputs)))
    if args.mode == "tnt":
        model = tnt.Model(model)
    model.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)  # 13 = 3 * 4 + 1: a cycle under way
    path = os.path.join(args.out, "inside-a-cycle.keras")
    model.save(path)
    model = tnt.models.load_model(path) if args.mode == "tnt" else keras.models.load_model(path)
    history = model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    rank = tnt.get_rank() if args.mode == "tnt" else 0
    arrays = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    arrays["history_loss"] = np.array(history.history["loss"])
    np.savez(os.path.join(args.out, f"accumulation-save-load.rank{rank}.npz"), **arrays)
    if rank == 0:
        np.savez(os.path.join(args.out, "accumulation-save-load.accumulators.npz"),
                 *[np.array(a.numpy()) for a in model.optimizer._accumulated_gradients])


if __name__ == "__main__":
    sys.exit(main())
