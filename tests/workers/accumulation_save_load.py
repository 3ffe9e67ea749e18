"""Gradient accumulation and saving: every way of saving inside an accumulation cycle writes serial
Keras' accumulators, and a fit that goes on from a save inside a cycle goes on as serial Keras.
`--mode serial` uses plain Keras, `--mode tnt` tnt.Model; each saves the final weights (every rank)
and the accumulators each saved file holds (the master, or serially)."""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Global batches of 5 (2/2/1 on 3 ranks), the last of 1 (1/0/0): 13 micro-steps per epoch, k = 4.
SAMPLES, BATCH, STEPS = 61, 5, 4


def build(keras):
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(
        keras.layers.Dense(16, activation="relu")(inputs)))


def compile_model(keras, model):
    model.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=STEPS), "sparse_categorical_crossentropy")


def saved_accumulators(keras, np, path):
    """The accumulators a saved file holds, read with plain Keras."""
    if path.endswith(".keras"):
        model = keras.models.load_model(path)
    else:
        model = build(keras)
        compile_model(keras, model)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
    return [np.array(a.numpy()) for a in model.optimizer._accumulated_gradients]


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
    x, y = rng.normal(size=(SAMPLES, 8)).astype("float32"), rng.integers(0, 3, SAMPLES)
    rank = tnt.get_rank() if args.mode == "tnt" else 0
    model = build(keras)
    if args.mode == "tnt":
        model = tnt.Model(model)
    compile_model(keras, model)
    files = {  # what each saves: the accumulators after that many micro-steps
        "checkpoint-every-5-batches.keras": 10,  # its last save, 10 = 2 * 4 + 2
        "checkpoint-at-epoch-end.keras": 13,  # 13 = 3 * 4 + 1
        "backup-every-7-batches/latest.weights.h5": 7,
        f"saved-on-every-rank.rank{rank}.weights.h5": 14,
        "inside-a-cycle.keras": 14,
    }
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "checkpoint-every-5-batches.keras"), save_freq=5),
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "checkpoint-at-epoch-end.keras")),
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup-every-7-batches"), save_freq=7,
                                         delete_checkpoint=False),
    ]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    model.train_on_batch(x[:BATCH], y[:BATCH])  # the 14th micro-step
    every_rank = os.path.join(args.out, f"saved-on-every-rank.rank{rank}.weights.h5")
    if args.mode == "tnt":
        model.save_weights(every_rank, tnt_save_all_devices=True)
    else:
        model.save_weights(every_rank)
    path = os.path.join(args.out, "inside-a-cycle.keras")
    model.save(path)
    model = tnt.models.load_model(path) if args.mode == "tnt" else keras.models.load_model(path)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    arrays = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    arrays["history_loss"] = np.array(history.history["loss"])
    np.savez(os.path.join(args.out, f"accumulation-save-load.rank{rank}.npz"), **arrays)
    if rank == 0:
        np.savez(os.path.join(args.out, "accumulation-save-load.accumulators.npz"),
                 *[np.array(a.numpy()) for a in model.optimizer._accumulated_gradients])
    # Each rank's own file, and the master's others: as serial Keras wrote them after those micro-steps.
    mine = [name for name in files if name.startswith("saved-on-every-rank") or rank == 0]
    for name in mine:
        accumulators = saved_accumulators(keras, np, os.path.join(args.out, name))
        assert any(np.any(a) for a in accumulators), f"{name}: no cycle under way after {files[name]} micro-steps"
        np.savez(os.path.join(args.out, name.replace("/", "-").replace(f".rank{rank}", "") + f".rank{rank}.npz"),
                 *accumulators)


if __name__ == "__main__":
    sys.exit(main())
