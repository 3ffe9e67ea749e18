"""Checks tarantella's collectives against numpy on every rank; prints one line per rank."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tarantella as tnt  # noqa: E402
from tarantella.runtime import world  # noqa: E402

comm = world.init()
reducer = world.gradient_reducer()
# Bucket sizes around the ring threshold (1 MiB), odd lengths included.
for length in [1, 5, 1000, 262143, 262144 + 7, 1_000_003]:
    for dtype in (np.float32, np.float64):
        mine = np.random.default_rng(tnt.get_rank() * 7919 + length).normal(size=length).astype(dtype)
        everyone = comm.allgather(mine, "reference")
        reducer.submit(0, 2, mine)
        reducer.submit(1, 2, mine[: length // 2].copy())
        total, half = reducer.collect()
        np.testing.assert_allclose(total, np.sum(everyone, axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(half, np.sum(everyone, axis=0)[: length // 2], rtol=1e-5, atol=1e-5)
        results = comm.allgather(total.tobytes() + half.tobytes(), "comparison")
        assert all(result == results[0] for result in results), "ranks hold different sums"
rows = np.arange(tnt.get_rank(), 11, tnt.get_size(), dtype=np.float32)[:, None] * [1, -1]
(gathered,) = comm.allgather_interleaved_rows([rows.astype(np.float32)], "gather")
np.testing.assert_array_equal(gathered, np.arange(11, dtype=np.float32)[:, None] * [1, -1])
print(f"rank {tnt.get_rank()}: collectives agree", flush=True)
