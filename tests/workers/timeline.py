"""Trains under `tarantella --timeline FILE` for tests/test_timeline.py.

    timeline.py steady FOLDER   a small MLP: fit (with validation and a checkpoint), then a custom
                                loop of one tf.function step and an eager tnt.allreduce; writes the
                                model's gradient bytes and step counts to FOLDER/facts.json
    timeline.py straggler       each rank its own dataset (tnt_distribute_dataset=False); rank 1's
                                input map sleeps 60 ms per batch
    timeline.py xla-convnet     a convnet compiled with XLA, fit on arrays in memory: its input
                                arrives at once, its forward pass is one XLA computation
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tarantella as tnt  # noqa: E402

RANK, SIZE = tnt.get_rank(), tnt.get_size()
FIT_STEPS = 12
GLOBAL_BATCH = 32


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(300, activation="relu"), keras.layers.Dense(4)])


def data(samples):
    rng = np.random.default_rng(1)
    return rng.random((samples, 20), np.float32), rng.integers(0, 4, samples).astype(np.int32)


def steady(folder):
    model = tnt.Model(mlp())
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    x, y = data(GLOBAL_BATCH * FIT_STEPS)
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(folder, "model.keras"))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, validation_data=data(GLOBAL_BATCH * 2),
              callbacks=[checkpoint])

    # A custom loop: one tf.function step whose gradients go through tnt.optimizers, and a public collective.
    plain = mlp()
    optimizer = tnt.optimizers.Optimizer(keras.optimizers.SGD(0.01))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def custom_step(features, labels):
        with tf.GradientTape() as tape:
            value = loss(labels, plain(features))
        optimizer.apply_gradients(zip(tape.gradient(value, plain.trainable_variables), plain.trainable_variables))
        return value

    custom_step(x[:16], y[:16])
    tnt.allreduce(np.ones(3))
    if RANK == 0:
        gradient_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        with open(os.path.join(folder, "facts.json"), "w") as file:
            json.dump({"gradient_bytes": gradient_bytes, "fit_steps": FIT_STEPS}, file)


def straggler():
    model = tnt.Model(mlp())
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(GLOBAL_BATCH // SIZE * 12)

    def slow_on_rank_1(features):
        if RANK == 1:
            time.sleep(0.06)
        return features

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH // SIZE).map(
        lambda f, l: (tf.numpy_function(slow_on_rank_1, [f], tf.float32, stateful=True), l))
    dataset = dataset.map(lambda f, l: (tf.ensure_shape(f, [None, 20]), l))
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # no buffer filled in the background
    dataset = dataset.with_options(options)
    model.fit(dataset, epochs=1, verbose=0, tnt_distribute_dataset=False)


def xla_convnet():
    keras.utils.set_random_seed(0)
    model = tnt.Model(keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(10)]))
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    rng = np.random.default_rng(1)
    x, y = rng.random((64 * FIT_STEPS, 32, 32, 3), np.float32), rng.integers(0, 10, 64 * FIT_STEPS)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)


if __name__ == "__main__":
    {"steady": lambda: steady(sys.argv[2]), "straggler": straggler, "xla-convnet": xla_convnet}[sys.argv[1]]()
