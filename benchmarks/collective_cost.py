"""The fixed cost of one small collective (32 bytes) through tarantella, against a bare mpi4py
Allreduce in the same processes (issue 22 point 4).

    tarantella -n 2 -- benchmarks/collective_cost.py [--rounds 10] [--calls 200]

Per round, each way of summing int64[3] over the ranks runs `--calls` times in a row, the ways
in turn (the next round in reverse order), and the round keeps each way's median call; the
output is the median over rounds with the interquartile range, and each way against the target
2 x bare + 30 us. The ways:
  bare              MPI Allreduce from the main thread (a duplicate of COMM_WORLD)
  worker            Communicator.allreduce_sum: the hand-off to the worker thread, the agreement
                    allreduce, the allreduce, the hand-back (what a collective outside a step costs)
  worker, agreed    the same without the agreement (what each collective inside a step costs)
  tnt.allreduce     the public collective, eager (agreement, a layout allgather, the allreduce)
  tnt.allreduce in tf.function
                    the same from a stateful numpy_function in a tf.function
  in-step           a tf.function calling allreduce_sum(agreed=True) from a numpy_function, as the
                    step's losses-and-metrics collective does
  numpy_function floor
                    a tf.function calling a numpy_function that returns its input: what any host
                    call from a TensorFlow graph costs before it communicates
  bare in numpy_function
                    the bare Allreduce from a numpy_function in a tf.function, on TensorFlow's
                    thread: the least a collective inside a step can cost without a worker thread
                    (and without the fixed order that thread keeps)
With TNT_TIMELINE set (tarantella --timeline FILE) the master also splits each way's calls, from
the recorded events, into the hand-off to the worker (the caller's call to the worker's start),
the collective on the worker, and the hand-back (the worker's end to the caller's return).
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import tarantella as tnt
from tarantella import timeline
from tarantella.runtime import world as tnt_world


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    comm = tnt_world.init()
    MPI = tnt_world.mpi()
    world = MPI.COMM_WORLD.Dup()
    values = np.ones(3, np.int64)

    def bare():
        world.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)

    @tf.function
    def public_in_function(tensor):
        return tnt.allreduce(tensor)

    @tf.function
    def in_step(tensor):
        return tf.numpy_function(lambda array: comm.allreduce_sum(array, "in-step", agreed=True),
                                 [tensor], tf.int64, stateful=True)

    @tf.function
    def numpy_function_floor(tensor):
        return tf.numpy_function(lambda array: array, [tensor], tf.int64, stateful=True)

    def bare_on_this_thread(array):
        world.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array

    @tf.function
    def bare_in_numpy_function(tensor):
        return tf.numpy_function(bare_on_this_thread, [tensor], tf.int64, stateful=True)

    tensor = tf.constant(values)
    ways = {
        "bare": bare,
        "worker": lambda: comm.allreduce_sum(values, "worker"),
        "worker, agreed": lambda: comm.allreduce_sum(values, "worker, agreed", agreed=True),
        "tnt.allreduce": lambda: tnt.allreduce(values),
        "tnt.allreduce in tf.function": lambda: public_in_function(tensor),
        "in-step": lambda: in_step(tensor),
        "numpy_function floor": lambda: numpy_function_floor(tensor),
        "bare in numpy_function": lambda: bare_in_numpy_function(tensor),
    }
    per_round = {name: [] for name in ways}
    for way in ways.values():  # tracing and first calls
        for _ in range(20):
            way()
    if timeline.recorder is not None:
        timeline.recorder.events.clear()
    for round_number in range(args.rounds):
        order = list(ways) if round_number % 2 == 0 else list(ways)[::-1]
        for name in order:
            world.Barrier()
            seconds = []
            for _ in range(args.calls):
                started = time.perf_counter()
                ways[name]()
                seconds.append(time.perf_counter() - started)
            per_round[name].append(statistics.median(seconds))
    world.Free()
    if comm.rank != 0:
        return
    if timeline.recorder is not None:
        print_hand_offs(timeline.recorder.events)
    bare_us = statistics.median(per_round["bare"]) * 1e6
    target = 2 * bare_us + 30
    print(f"{comm.size} ranks, {args.rounds} rounds of {args.calls} calls; us per call: median over rounds "
          f"(interquartile range); target 2 x bare + 30 = {target:.1f} us")
    for name, medians in per_round.items():
        q1, median, q3 = statistics.quantiles([m * 1e6 for m in medians], n=4, method="inclusive")
        verdict = "" if name == "bare" else ("  met" if q3 <= target else "  MISSED" if q1 > target else
                                             "  spread too large to judge")
        print(f"  {name:<30}{median:>8.1f} ({q1:.1f}-{q3:.1f}){verdict}")


def print_hand_offs(events):
    """From the timeline's events: medians of each way's hand-off, worker and hand-back, in us."""
    parts = {}
    for worker, caller in zip(events, events[1:]):  # the worker records a call just before its caller
        if worker[0] == "collective" and caller[0] == "blocked" and worker[3] == caller[3]:
            _, _, _, what, started, ended = worker
            parts.setdefault(what, []).append((started - caller[4], ended - started, caller[5] - ended))
    print("From the timeline (us, medians): hand-off to the worker / collective on the worker / hand-back")
    for what, calls in parts.items():
        if what in ("worker", "worker, agreed", "in-step") or what.startswith("tnt."):
            print(f"  {what:<30}" + " / ".join(f"{statistics.median(c[i] for c in calls) / 1e3:.1f}" for i in range(3)))


if __name__ == "__main__":
    main()
