"""Runs one feature that tnt.Model does not have on Keras' JAX backend yet, on every rank.

Each must raise a clear error on every rank, before any collective, so that no rank hangs.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import tarantella as tnt  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402


class OwnTrainStep(keras.Sequential):
    def train_step(self, state, data):
        return super().train_step(state, data)


def synchronized_moments_in_custom_step():
    import numpy as np

    model = tnt.Model(OwnTrainStep([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]),
                      synchronized_batch_normalization=True)
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)


def collective_in_jit():
    jax.jit(lambda v: tnt.allreduce(v))(jnp.ones(3))


def local_logs():
    import numpy as np

    model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0,
              callbacks=[tnt.keras.callbacks.Callback(keras.callbacks.Callback(), aggregate_logs=False)])


def predict_steps_per_execution():
    import numpy as np

    model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile("sgd", "mse", steps_per_execution=2)
    model.predict(np.ones((8, 4), "float32"), batch_size=4, verbose=0)


FEATURES = {f.__name__: f for f in (synchronized_moments_in_custom_step, collective_in_jit, local_logs,
                                    predict_steps_per_execution)}

if __name__ == "__main__":
    # A refusing rank ends normally, so that no rank's failure stops the others before they print.
    try:
        FEATURES[sys.argv[1]]()
    except NotImplementedError as refusal:
        print(f"rank {tnt.get_rank()} refused: {' '.join(str(refusal).split())}", flush=True)  # Keras may wrap it over lines
    else:
        sys.exit(f"rank {tnt.get_rank()}: {sys.argv[1]} was not refused")
