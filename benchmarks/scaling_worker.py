"""One measurement for benchmarks/scaling.py: trains one model and records its step times.

Variants:
  keras         plain Keras; tarantella is never imported
  tarantella    tnt.Model, as many ranks as the launcher starts (1 with plain `python`)
  no-allreduce  tnt.Model with the gradient allreduce replaced by the identity: the
                compute-only ceiling of a multi-rank step

The master rank writes {"parameters": ..., "step_seconds": [...]} as JSON to --output.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH_SIZE = 128
BATCHES_OF_DATA = 8  # distinct random batches, repeated for as many steps as needed
SEED = 0


def lenet5():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(6, 5, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 5, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(120, activation="relu"),
        keras.layers.Dense(84, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="lenet5")


def mlp():
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="mlp")


MODELS = {"lenet5": lenet5, "mlp": mlp}


def random_dataset(input_shape):
    rng = np.random.default_rng(SEED)
    samples = GLOBAL_BATCH_SIZE * BATCHES_OF_DATA
    x = rng.random((samples,) + tuple(input_shape), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE).repeat()


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step_seconds = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step_seconds.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--variant", choices=["keras", "tarantella", "no-allreduce"], required=True)
    parser.add_argument("--steps", type=int, required=True, help="timed steps")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed first steps (tracing)")
    parser.add_argument("--output", required=True, help="JSON file the master rank writes")
    args = parser.parse_args()

    is_master = True
    if args.variant != "keras":
        import tarantella as tnt
        if args.variant == "no-allreduce":
            # Each rank applies its own gradients: the same compute, no gradient traffic.
            import tarantella.gradients
            tarantella.gradients.GradientAllreduce.__call__ = lambda self, grads: list(grads)
        is_master = tnt.is_master_rank()

    keras.utils.set_random_seed(SEED)
    model = MODELS[args.model]()
    parameters = model.count_params()
    dataset = random_dataset(model.input_shape[1:])
    if args.variant != "keras":
        model = tnt.Model(model)
    # Multi-rank tarantella steps never use XLA; keep every variant on the same kind of step.
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    timer = StepTimer()
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[timer],
              steps_per_epoch=args.warmup_steps + args.steps)

    if is_master:
        with open(args.output, "w") as output:
            json.dump({"parameters": parameters, "step_seconds": timer.step_seconds[args.warmup_steps:]},
                      output)


if __name__ == "__main__":
    main()
