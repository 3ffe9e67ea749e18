"""A serial training program run with plain `python` where MPI cannot be loaded.

`without_mpi.py OUT` trains a tnt.Model and, in the same process, the same model with plain
Keras, and writes the largest weight difference and what tarantella saw to OUT (JSON)."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tarantella as tnt  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402


def build():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(100, 6)).astype(np.float32), rng.integers(0, 3, 100)
serial = build()
serial_history = serial.fit(x, y, batch_size=16, epochs=2, verbose=0)
model = tnt.Model(build())
model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
total = tnt.allreduce(np.array([1.0, 2.0]))
with open(sys.argv[1], "w") as file:
    json.dump({"size": tnt.get_size(), "rank": tnt.get_rank(), "mpi_loaded": "mpi4py.MPI" in sys.modules,
               "allreduce": np.asarray(total).tolist(),
               "weights_difference": max(float(np.max(np.abs(a - b)))
                                         for a, b in zip(model.get_weights(), serial.get_weights())),
               "loss": history.history["loss"], "serial_loss": serial_history.history["loss"]}, file)
