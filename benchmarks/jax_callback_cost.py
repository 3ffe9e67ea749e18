"""The fixed cost of reaching MPI from a jitted JAX step: an ordered io_callback through the
communicator's worker against a bare mpi4py Allreduce, and the jitted LeNet-5 step of tnt.Model
on Keras-on-JAX against serial Keras-on-JAX's (same micro-batch).

    KERAS_BACKEND=jax tarantella -n 2 -- benchmarks/jax_callback_cost.py
"""

import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import tarantella as tnt  # noqa: E402  (makes this process a rank)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

from tarantella.runtime import world  # noqa: E402

REPEATS = 2000


def median_us(function, repeats=REPEATS):
    function()  # compile, warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1e6 * float(np.median(times))


def main():
    comm = world.init()
    MPI = world.mpi()
    vector = np.ones(16, np.float32)

    def bare():
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, vector.copy(), op=MPI.SUM)

    def through_worker():
        comm.allreduce_sum(vector, "a measured allreduce", agreed=True)

    summed = jax.jit(lambda v: io_callback(
        lambda a: comm.allreduce_sum(np.asarray(a), "a measured allreduce", agreed=True),
        jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=True))
    jitted = lambda: summed(jnp.asarray(vector)).block_until_ready()

    rows = [("bare mpi4py Allreduce, 64 bytes", median_us(bare)),
            ("the communicator's worker (allreduce_sum)", median_us(through_worker)),
            ("a jitted io_callback(ordered=True) to it", median_us(jitted))]
    rows += lenet5_steps(comm)
    if comm.rank == 0:
        for name, value in rows:
            print(f"{name:55s} {value:9.1f} us")


def lenet5_steps(comm):
    """The jitted train step of LeNet-5, micro-batch 64 per rank: serial Keras' and tnt.Model's."""
    layers = keras.layers
    model = lambda: keras.Sequential([
        keras.Input((28, 28, 1)), layers.Conv2D(6, 5, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(16, 5, activation="relu"), layers.MaxPooling2D(), layers.Flatten(),
        layers.Dense(120, activation="relu"), layers.Dense(84, activation="relu"), layers.Dense(10)])
    x = np.random.default_rng(0).normal(size=(64 * comm.size, 28, 28, 1)).astype("float32")
    y = np.zeros(64 * comm.size, "int64")
    rows = []
    for name, wrap in (("serial Keras-on-JAX step (64 samples)", None), ("tnt.Model step (64 samples per rank)", tnt.Model)):
        keras.utils.set_random_seed(1)
        m = model() if wrap is None else wrap(model())
        m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        batch = (x[:64], y[:64]) if wrap is None else (x, y)
        m.train_on_batch(*batch)
        rows.append((name, median_us(lambda: m.train_on_batch(*batch), repeats=200)))
    return rows


if __name__ == "__main__":
    main()
