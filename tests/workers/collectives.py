"""Checks tarantella's collectives against numpy on every rank; prints one line per rank."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import tarantella as tnt  # noqa: E402
from tarantella.runtime import world  # noqa: E402

comm = world.init()
reducer = world.gradient_reducer()
expected = "ByNode" if os.environ.get("TNT_HIERARCHICAL_ALLREDUCE") == "on" else "SumOverRanks"
assert type(reducer.reduction).__name__ == expected, type(reducer.reduction)
# Bucket sizes around the ring threshold (1 MiB), odd lengths included.
for length in [1, 5, 1000, 262143, 262144 + 7, 1_000_003]:
    for dtype in (np.float32, np.float64):
        mine = np.random.default_rng(tnt.get_rank() * 7919 + length).normal(size=length).astype(dtype)
        everyone = comm.allgather(mine, "reference")
        # Copied before `mine` is handed over: the worker may sum it in place at once.
        first_half = mine[: length // 2].copy()
        reducer.submit(0, 2, mine)
        reducer.submit(1, 2, first_half)
        total, half = reducer.collect()
        np.testing.assert_allclose(total, np.sum(everyone, axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(half, np.sum(everyone, axis=0)[: length // 2], rtol=1e-5, atol=1e-5)
        results = comm.allgather(total.tobytes() + half.tobytes(), "comparison")
        assert all(result == results[0] for result in results), "ranks hold different sums"
# The 16-bit wires: each rank's bucket rounded once, added in float32 in rank order, the sum rounded
# once; bitwise the same on every rank. Float64 buckets (the sample counts) stay exact.
for wire, dtype16 in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
    wire_reducer = world.gradient_reducer(wire)
    assert wire_reducer is world.gradient_reducer(wire) and wire_reducer is not reducer
    for length in [1, 5, 262144 + 7]:
        mine = np.random.default_rng(tnt.get_rank() * 31 + length).normal(size=length).astype(np.float32)
        exact = np.random.default_rng(tnt.get_rank() + length).normal(size=3)
        everyone, everyone_exact = zip(*comm.allgather((mine, exact), "reference"))
        wire_reducer.submit(0, 2, mine.copy())
        wire_reducer.submit(1, 2, exact.copy())
        summed, summed_exact = wire_reducer.collect()
        rounded = np.zeros(length, np.float32)
        for contribution in everyone:
            rounded += contribution.astype(dtype16).astype(np.float32)
        np.testing.assert_array_equal(summed, rounded.astype(dtype16).astype(np.float32))
        assert summed.dtype == np.float32
        np.testing.assert_allclose(summed, np.sum(everyone, axis=0), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(summed_exact, np.sum(everyone_exact, axis=0), rtol=1e-12)
        assert not np.array_equal(summed, np.sum(everyone, axis=0)) or length == 1
rows = np.arange(tnt.get_rank(), 11, tnt.get_size(), dtype=np.float32)[:, None] * [1, -1]
(gathered,) = comm.allgather_interleaved_rows([rows.astype(np.float32)], "gather")
np.testing.assert_array_equal(gathered, np.arange(11, dtype=np.float32)[:, None] * [1, -1])
print(f"rank {tnt.get_rank()}: collectives agree", flush=True)
