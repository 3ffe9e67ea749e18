"""keras.random's draws in a custom step on the backend KERAS_BACKEND names (jax or torch), one process
playing every rank: under the backend step's `_serial_draws` (tarantella/backends/batch_draws.py), a
rank's draw of k*m rows (its m samples, k stacked blocks) is its rows r, r + p, ... of each block of
serial Keras' draw of k*B rows, from the same seed (torch's truncated_normal, which draws with normal,
included); a draw of another shape is serial Keras' own; each draw advances the seed generator once,
as serially. On JAX the draws are jitted with B traced, as in the step. First it checks that Keras still
draws through the functions batch_draws.py replaces. Prints "serial draws ok".

    KERAS_BACKEND=jax python tests/workers/serial_draws.py
"""

import functools
import inspect
import types

import keras
import numpy as np

from tarantella import backends
from tarantella.backends import batch_draws

BACKEND = keras.backend.backend()
DRAWS = {
    "normal": lambda shape, seed: keras.random.normal(shape, seed=seed),
    "uniform": lambda shape, seed: keras.random.uniform(shape, seed=seed),
    "truncated_normal": lambda shape, seed: keras.random.truncated_normal(shape, seed=seed),
    "randint": lambda shape, seed: keras.random.randint(shape, 0, 1000, seed=seed),
}


def draws(shapes, seed):
    """One draw of each of DRAWS per shape, one after the other from `seed`."""
    return [DRAWS[name](shape, seed) for name in DRAWS for shape in shapes]


def draws_of_rank(rank, size, rows, global_rows, shapes):
    """The rank's draws of `shapes` (see `draws`) from one seed generator, and its state after them;
    with `rows` 0, serial Keras' (the step leaves draws as they are)."""
    step = types.SimpleNamespace(_comm=types.SimpleNamespace(rank=rank, size=size))
    serial_draws = backends.step_class()._serial_draws
    seed = keras.random.SeedGenerator(5)
    if BACKEND != "jax":
        with serial_draws(step, rows, global_rows):
            drawn = draws(shapes, seed)
        return [keras.ops.convert_to_numpy(d) for d in drawn], keras.ops.convert_to_numpy(seed.state.value)
    import jax

    @jax.jit
    def draw(state, global_rows):
        with keras.StatelessScope(state_mapping=[(seed.state, state)]) as scope, \
                serial_draws(step, rows, global_rows):
            drawn = draws(shapes, seed)
        return drawn, scope.get_current_value(seed.state)

    drawn, state = draw(seed.state.value, np.int32(global_rows))
    return [np.asarray(d) for d in drawn], np.asarray(state)


def check_the_keras_internals_replaced():
    """batch_draws.py replaces the backend random module's SHAPED_DRAWS: keras.random must still call
    them, shape first, looked up at call time; on JAX the first rows of a longer draw must be the
    shorter draw, since the step draws as many rows as the global batch can have and keeps the first."""
    random_module = getattr(keras.src.backend, BACKEND).random
    calls = []
    originals = {name: getattr(random_module, name) for name in batch_draws.SHAPED_DRAWS}
    for name, original in originals.items():
        assert list(inspect.signature(original).parameters)[0] == "shape", (name, inspect.signature(original))
        setattr(random_module, name, functools.partial(_watched, calls, name, original))
    try:
        draws([(2, 3)], keras.random.SeedGenerator(1))
    finally:
        for name, original in originals.items():
            setattr(random_module, name, original)
    missing = [name for name in batch_draws.SHAPED_DRAWS if name not in calls]
    assert not missing, f"keras.random no longer calls keras.src.backend.{BACKEND}.random's {missing} at call time"
    if BACKEND == "jax":
        short, long = keras.random.normal((6, 3), seed=7), keras.random.normal((10, 3), seed=7)
        assert np.array_equal(np.asarray(short), np.asarray(long)[:6]), \
            "JAX's draws no longer depend on their position alone (jax_threefry_partitionable)"


def _watched(calls, name, original, shape, *args, **kwargs):
    calls.append(name)
    return original(shape, *args, **kwargs)


def main():
    check_the_keras_internals_replaced()
    # 7 rows on 3 ranks: 3, 2 and 2; 1 row on 2 ranks: rank 0's one row, of which every first dimension
    # is a multiple (rank 1, without samples, draws as it is: its numbers are never used).
    for size, global_rows in ((3, 7), (2, 1)):
        for rank in range(size):
            rows = len(range(rank, global_rows, size))
            if rows:
                # A draw of a shape that is no multiple of the rank's rows is serial Keras' own.
                other = (rows + 1, 2) if rows > 1 else ()
                serial, _ = draws_of_rank(0, 1, 0, global_rows, [(global_rows, 3), (2 * global_rows, 1), other])
                drawn, state = draws_of_rank(rank, size, rows, global_rows, [(rows, 3), (2 * rows, 1), other])
                own = np.arange(rank, global_rows, size)
                for i, name in enumerate(DRAWS):
                    context = f"{BACKEND} {name}: rank {rank} of {size}, {rows} of {global_rows} rows"
                    one, two, three = drawn[3 * i:3 * i + 3]
                    expected = serial[3 * i:3 * i + 3]
                    np.testing.assert_array_equal(one, expected[0][own], err_msg=context)
                    np.testing.assert_array_equal(two, expected[1][np.concatenate([own, global_rows + own])],
                                                  err_msg=context)
                    np.testing.assert_array_equal(three, expected[2], err_msg=context)
                np.testing.assert_array_equal(state, [5, 3 * len(DRAWS)], err_msg=f"{BACKEND}: the seed's state")
    print("serial draws ok")


if __name__ == "__main__":
    main()
