"""Trains one step and prints the platform this rank's weights live on: "gpu" or "cpu"."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tarantella as tnt  # noqa: E402
import keras  # noqa: E402

model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
weight = model.trainable_variables[0].value
backend = keras.backend.backend()
if backend == "jax":
    on_gpu = next(iter(weight.devices())).platform == "gpu"
elif backend == "torch":
    on_gpu = weight.device.type == "cuda"
else:
    on_gpu = "GPU" in weight.device
print(f"rank {tnt.get_rank()} trains on {'gpu' if on_gpu else 'cpu'}", flush=True)
