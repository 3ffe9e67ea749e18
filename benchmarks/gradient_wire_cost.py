"""What a 16-bit gradient wire costs on one machine, where bytes are cheap: one bucket summed over
the ranks through the float32 reducer and through the bfloat16 and float16 wires.

    tarantella -n 2 -- benchmarks/gradient_wire_cost.py [--megabytes 1,16,100] [--rounds 7]

Per round, each wire sums a float32 bucket of each size 3 times (the wires in turn, the next
round in reverse order) and keeps its median; the master prints the median over rounds with the
interquartile range, in ms and against float32. On one machine the link is memory, so this shows
the wire's CPU cost (rounding to 16 bits and widening back, MPI's all-to-all and allgather against
the ring), not what it saves on a network: benchmarks/emulated_cluster.py's wire-W variants do,
with sizes divided by its byte scale, which divides this cost too.
"""

import argparse
import statistics
import time

import numpy as np

import tarantella as tnt
from tarantella.runtime import world

WIRES = ("float32", "bfloat16", "float16")


def timed_sum(reducer, bucket):
    started = time.perf_counter()
    reducer.submit(0, 1, bucket)
    reducer.collect()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", default="1,16,100")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sizes = [float(mb) for mb in args.megabytes.split(",")]
    comm = world.init()
    reducers = {wire: world.gradient_reducer(wire) for wire in WIRES}
    rng = np.random.default_rng(tnt.get_rank())
    buckets = {mb: rng.normal(size=int(mb * 1e6 / 4)).astype(np.float32) for mb in sizes}
    seconds = {(mb, wire): [] for mb in sizes for wire in WIRES}
    for round_number in range(args.rounds):
        order = WIRES if round_number % 2 == 0 else WIRES[::-1]
        for mb in sizes:
            for wire in order:
                calls = [timed_sum(reducers[wire], buckets[mb].copy()) for _ in range(3)]
                seconds[(mb, wire)].append(statistics.median(calls))
    if comm.rank != 0:
        return
    print(f"One bucket summed over {comm.size} ranks on one machine, median over {args.rounds} rounds (IQR):")
    print("| MB | wire | ms | against float32 |")
    print("|---|---|---|---|")
    for mb in sizes:
        for wire in WIRES:
            times = seconds[(mb, wire)]
            q1, median, q3 = np.percentile(times, [25, 50, 75])
            ratios = [t / f for t, f in zip(times, seconds[(mb, "float32")])]
            r1, ratio, r3 = np.percentile(ratios, [25, 50, 75])
            print(f"| {mb:g} | {wire} | {median * 1e3:.1f} ({q1 * 1e3:.1f}-{q3 * 1e3:.1f}) | "
                  f"{ratio:.2f} ({r1:.2f}-{r3:.2f}) |")


if __name__ == "__main__":
    main()
