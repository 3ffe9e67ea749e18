"""Random draws in a model's own step on JAX and torch, made as serial Keras makes them for the global batch.

keras.random draws from a seed (a SeedGenerator's state, alike on every rank: each draw advances it
alike), so a draw of the same shape gives every rank serial Keras' numbers. A draw for the batch does
not: its first dimension is the rank's m rows where serial Keras' is the global batch's B. A draw whose
first dimension is k times m (k = 1: a latent vector or an epsilon per sample; k = 2: a GAN's labels
for generated and real images, stacked) is therefore made as serial Keras makes it, k stacked blocks of
B rows, and the rank keeps its rows of each block: r, r + p, r + 2p, ... (tnt splits every global
batch so). The backend gives B and how many rows to draw: B itself on torch; on JAX, where B is known
only when the jitted step runs, the most rows B can have (r + p*m): in JAX's default threefry PRNG
(partitionable, since JAX 0.5) a number depends on its position, not on the shape, so the first k*B
rows of that draw are the draw of k*B rows.

A draw of another layout (one per token of m*T flattened rows) keeps the rank's rows of k = T blocks:
numbers as random as the serial ones, but not theirs. A rank without samples draws as it is: its
numbers are never used, and its seeds advance as every rank's.
"""

import contextlib

import numpy as np
from keras import ops

# Keras' random functions that take the shape to draw as their first argument.
SHAPED_DRAWS = ("normal", "uniform", "truncated_normal", "randint")


@contextlib.contextmanager
def serial_draws(random_module, rows, rank, size, global_rows, drawn_rows):
    """While a step of the rank's `rows` runs: the draws of Keras' backend `random_module` (its
    SHAPED_DRAWS) for k*`rows` rows give the rank's rows of serial Keras' draw for k*`global_rows`.

    Args:
        random_module: the backend's random module (keras.src.backend.<backend>.random).
        rows: m, the rank's samples (0: draws are left as they are).
        rank, size: the rank r and the number of ranks p.
        global_rows: B, the global batch's samples (an int, or a traced scalar).
        drawn_rows: the rows to draw per block, a static int of at least B: the first k*B rows of a
            draw of k*`drawn_rows` are the draw of k*B rows.
    """
    originals = {name: getattr(random_module, name) for name in SHAPED_DRAWS}
    drawing = []  # a draw under way, whose own draws (torch's truncated_normal calls normal) are part of it
    if rows:
        for name, original in originals.items():
            setattr(random_module, name,
                    _of_the_global_batch(original, drawing, rows, rank, size, global_rows, drawn_rows))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(random_module, name, original)


def _of_the_global_batch(draw, drawing, rows, rank, size, global_rows, drawn_rows):
    def draw_for_the_global_batch(shape, *args, **kwargs):
        shape = tuple(shape)
        if drawing or not shape or shape[0] == 0 or shape[0] % rows:
            return draw(shape, *args, **kwargs)
        blocks = shape[0] // rows
        drawing.append(draw)
        try:
            whole = draw((blocks * drawn_rows, *shape[1:]), *args, **kwargs)
        finally:
            drawing.pop()
        return ops.take(whole, rank_positions(blocks, rows, rank, size, global_rows), axis=0)

    return draw_for_the_global_batch


def rank_positions(blocks, rows, rank, size, global_rows):
    """Where the rank's `rows` rows lie in `blocks` stacked blocks of the global batch's `global_rows`."""
    own = rank + size * np.arange(rows)
    return ops.concatenate([own + block * global_rows for block in range(blocks)])
