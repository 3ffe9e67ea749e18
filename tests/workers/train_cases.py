"""Trains a list of (model, optimizer, data) cases and saves what a user would compare.

`--mode serial` uses plain Keras and never imports tarantella; `--mode tnt` wraps every
model in tnt.Model and saves one file per case and rank. Tests compare the two.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES = 135  # with batch 64: batches of 64, 64 and 7 (split 2 ways evenly, 3 ways unevenly)

OPTIMIZERS = {
    "sgd": lambda k: k.optimizers.SGD(0.05),
    "momentum": lambda k: k.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda k: k.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda k: k.optimizers.Adam(0.01),
    "adamw": lambda k: k.optimizers.AdamW(0.01, weight_decay=0.01),
    "rmsprop": lambda k: k.optimizers.RMSprop(0.005),
    "adagrad": lambda k: k.optimizers.Adagrad(0.05),
    "adadelta": lambda k: k.optimizers.Adadelta(1.0),
    "adamax": lambda k: k.optimizers.Adamax(0.01),
    "nadam": lambda k: k.optimizers.Nadam(0.01),
}
ACCUMULATION_STEPS = 4
# Optimizers of the cases below only.
OTHER_OPTIMIZERS = {
    "adam-accumulation": lambda k: k.optimizers.Adam(0.01, gradient_accumulation_steps=ACCUMULATION_STEPS),
}


def build_mlp(keras):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def build_wide_mlp(keras):
    # A 512x512 kernel is 1 MiB: its gradient bucket takes the ring allreduce.
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(512, activation="relu")(keras.layers.Dense(512, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def build_lenet5(keras):
    layers = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(6, 5, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(16, 5, activation="relu"), layers.MaxPooling2D(), layers.Flatten(),
        layers.Dense(120, activation="relu"), layers.Dense(84, activation="relu"),
        layers.Dense(3, activation="softmax")])


def build_tuple_input(keras):
    left, right = keras.Input((8,)), keras.Input((4,))
    merged = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(left), right])
    return keras.Model((left, right), keras.layers.Dense(3, activation="softmax")(merged))


def build_dict_input(keras):
    inputs = {"a": keras.Input((8,), name="a"), "b": keras.Input((4,), name="b")}
    merged = keras.layers.Concatenate()([inputs["a"], keras.layers.Dense(4, activation="tanh")(inputs["b"])])
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(merged))


def build_subclassed(keras):
    class TwoLayers(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.out(self.hidden(x))

    return TwoLayers()


MODELS = {"mlp": build_mlp, "wide-mlp": build_wide_mlp, "lenet5": build_lenet5, "tuple": build_tuple_input,
          "dict": build_dict_input, "subclassed": build_subclassed}


def make_data(np, tf, model_name, batch_size, shuffle_seed, map_before_batch):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, SAMPLES)
    if model_name == "lenet5":
        features = rng.normal(size=(SAMPLES, 28, 28, 1)).astype("float32")
    elif model_name == "tuple":
        features = (rng.normal(size=(SAMPLES, 8)).astype("float32"), rng.normal(size=(SAMPLES, 4)).astype("float32"))
    elif model_name == "dict":
        features = {"a": rng.normal(size=(SAMPLES, 8)).astype("float32"),
                    "b": rng.normal(size=(SAMPLES, 4)).astype("float32")}
    else:  # the MLPs
        features = rng.normal(size=(SAMPLES, 8)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    if shuffle_seed is None:  # as tutorials shuffle: no seed of its own; the script's global seed decides
        dataset = dataset.shuffle(SAMPLES)
    else:
        dataset = dataset.shuffle(SAMPLES, seed=shuffle_seed)
    if map_before_batch:
        dataset = dataset.map(lambda x, y: (tf.nest.map_structure(lambda t: t * 0.5, x), y))
    return dataset.batch(batch_size).prefetch(2)


# name: (model, optimizer, global batch size, shuffle seed, map before batch[, compile arguments])
CASES = {f"mlp-{name}": ("mlp", name, 64, 7, True) for name in OPTIMIZERS}
# The other optimizers only change the update of the same summed gradient: these cases train
# and compare weights and History; evaluate and predict run in the others.
OPTIMIZER_ONLY_CASES = [name for name in CASES if name != "mlp-adam"]
CASES.update({
    "lenet5-momentum": ("lenet5", "momentum", 64, 7, False),
    "tuple-adam": ("tuple", "adam", 64, 7, True),
    "dict-momentum": ("dict", "momentum", 64, 7, True),
    "subclassed-adam": ("subclassed", "adam", 64, 7, False),
    "wide-mlp-adam": ("wide-mlp", "adam", 64, 7, True),
    "mlp-batch71": ("mlp", "momentum", 71, 7, True),
    "mlp-batch2": ("mlp", "sgd", 2, 7, False),
    "mlp-shuffle-without-seed": ("mlp", "adam", 64, None, True),
    "mlp-steps-per-execution": ("mlp", "nesterov", 16, 7, True, {"steps_per_execution": 3}),
    # Global batches of 67 (3 per epoch, the last of 1): 34/33 and 1/0 on 2 ranks, 23/22/22 and 1/0/0
    # on 3; the first accumulation cycle of 4 crosses the first epoch's end, and fit ends inside the
    # second.
    "mlp-accumulation": ("mlp", "adam-accumulation", 67, 7, True),
})


def count_gradient_rounds():
    """From now on, GRADIENT_ROUNDS counts the gradient rounds this rank's steps collect (tnt mode)."""
    from tarantella.runtime import world
    reducer = world.gradient_reducer()
    collect = reducer.collect

    def counted_collect():
        GRADIENT_ROUNDS[0] += 1
        return collect()

    reducer.collect = counted_collect


GRADIENT_ROUNDS = [0]  # the rounds this rank collected so far (tnt mode)


def run_case(name, mode, out_dir, verbose=0, jit_compile="auto"):
    import keras
    import numpy as np
    import tensorflow as tf

    model_name, optimizer_name, batch_size, shuffle_seed, map_before_batch, *compile_args = CASES[name]
    keras.utils.set_random_seed(11)
    model = MODELS[model_name](keras)
    if mode == "tnt":
        import tarantella as tnt
        model = tnt.Model(model)
    model.compile({**OPTIMIZERS, **OTHER_OPTIMIZERS}[optimizer_name](keras), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"], jit_compile=jit_compile,
                  **(compile_args[0] if compile_args else {}))
    data = lambda: make_data(np, tf, model_name, batch_size, shuffle_seed, map_before_batch)
    rounds_before = GRADIENT_ROUNDS[0] if mode == "tnt" else 0
    arrays = {}
    if name in OPTIMIZER_ONLY_CASES:
        history = model.fit(data(), epochs=2, verbose=verbose)
    else:
        history = model.fit(data(), epochs=2, validation_data=data(), verbose=verbose)
        arrays["evaluation"] = np.array(model.evaluate(data(), verbose=0))
        arrays["predictions"] = model.predict(data(), verbose=0)
    rank = tnt.get_rank() if mode == "tnt" else 0
    optimizer = model.optimizer
    if optimizer.gradient_accumulation_steps and rank == 0:  # a cycle under way: serial Keras' sums
        np.savez(os.path.join(out_dir, f"{name}.accumulators.npz"),
                 *[np.array(a.numpy()) for a in optimizer._accumulated_gradients])
    if mode == "tnt":
        with open(os.path.join(out_dir, f"{name}.rank{rank}.rounds"), "w") as rounds:
            rounds.write(str(GRADIENT_ROUNDS[0] - rounds_before))
    arrays.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **arrays)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--verbose", type=int, default=0, help="fit's verbose: 2 prints a line per epoch")
    parser.add_argument("--jit-compile", action="store_true", help="compile(jit_compile=True): XLA, serially too")
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before TensorFlow runs, as users should)
        count_gradient_rounds()
        if os.environ.get("TF_DUMP_GRAPH_PREFIX"):  # TensorFlow reads it at each dump: a folder per rank
            os.environ["TF_DUMP_GRAPH_PREFIX"] += f"/rank{tarantella.get_rank()}"
    for name in args.cases.split(","):
        run_case(name, args.mode, args.out, args.verbose, True if args.jit_compile else "auto")


if __name__ == "__main__":
    sys.exit(main())
