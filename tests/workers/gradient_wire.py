"""16-bit gradient wires against serial Keras, in every rank (KERAS_BACKEND picks the backend).

Each case trains serial Keras, untouched, and tnt.Model on the same global batches (71 samples in
batches of 16: uneven micro-batches, and a last batch of 7), then prints one JSON line per rank:
the wire tnt.Model chose, how far its weights, History and evaluate lie from serial Keras', how
many gradient rounds went through the reducer of that wire, and a digest of its weights (the
ranks' must be equal).
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tarantella as tnt  # noqa: E402
from tarantella.runtime import world  # noqa: E402

SAMPLES, BATCH = 71, 16
# name -> (the wire asked of tnt.Model (None: TNT_GRADIENT_WIRE, i.e. "auto"), the model's dtype policy)
CASES = {
    "float32-model-bfloat16-wire": ("bfloat16", "float32"),
    "float32-model-float16-wire": ("float16", "float32"),
    "float32-model-auto": (None, "float32"),
    "bfloat16-model-auto": (None, "bfloat16"),
    "bfloat16-model-float32-wire": ("float32", "bfloat16"),
}
# and "custom-loop-bfloat16-wire": tnt.optimizers.allreduce_gradients with TNT_GRADIENT_WIRE=bfloat16


def build(policy):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu", dtype=policy)(inputs)
    hidden = keras.layers.Dense(32, activation="relu", dtype=policy)(hidden)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax", dtype=policy)(hidden))


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 12)).astype(np.float32)
    return x, (x[:, :4].sum(axis=1) > 0).astype(np.int64) + 2 * (x[:, 4] > 0)


def train(model, x, y):
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    weights = [np.asarray(w, np.float32) for w in model.get_weights()]
    return weights, history.history["loss"], evaluation


def rounds_through(wire):
    """Counts the gradient rounds collected by the reducer of `wire`."""
    reducer, counted = world.gradient_reducer(wire), [0]
    collect = reducer.collect

    def counting():
        counted[0] += 1
        return collect()

    reducer.collect = counting
    return counted


def custom_loop():
    """tnt.optimizers.allreduce_gradients in a loop of one's own, TNT_GRADIENT_WIRE=bfloat16: one
    round, through the bfloat16 wire, against the exact sum of every rank's gradients."""
    mine = np.random.default_rng(tnt.get_rank()).normal(size=(3, 100)).astype(np.float32)
    counted = rounds_through("bfloat16")
    os.environ["TNT_GRADIENT_WIRE"] = "bfloat16"  # read at each call
    try:
        summed = tnt.optimizers.allreduce_gradients([keras.ops.convert_to_tensor(g) for g in mine],
                                                    num_samples=1, loss_reduction="sum")
    finally:
        del os.environ["TNT_GRADIENT_WIRE"]
    summed = np.stack([keras.ops.convert_to_numpy(g) for g in summed])
    exact = np.sum(world.init().allgather(mine, "the reference"), axis=0)
    return {"wire": "bfloat16", "rounds": counted[0], "loss_error": 0.0, "evaluate_error": 0.0,
            "weights_error": float(np.abs(summed - exact).max() / np.abs(exact).max()),
            "digest": hashlib.sha256(summed.tobytes()).hexdigest()}


def main():
    x, y = data()
    for name in sys.argv[1].split(","):
        if name == "custom-loop-bfloat16-wire":
            line = {"case": name, "rank": tnt.get_rank(), **custom_loop()}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            continue
        requested, policy = CASES[name]
        serial = train(build(policy), x, y)
        model = tnt.Model(build(policy), gradient_wire=requested)
        counted = rounds_through(model.gradient_wire)
        weights, losses, evaluation = train(model, x, y)
        scale = max(float(np.abs(w).max()) for w in serial[0])
        line = {
            "case": name, "rank": tnt.get_rank(), "wire": model.gradient_wire, "rounds": counted[0],
            "weights_error": max(float(np.abs(a - b).max()) for a, b in zip(weights, serial[0])) / scale,
            "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, serial[1])),
            "evaluate_error": max(abs(a - b) / abs(b) for a, b in zip(evaluation, serial[2])),
            "digest": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
        }
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
