"""The timeline (`tarantella --timeline FILE`, or TNT_TIMELINE=FILE): where each rank's time goes.

While it is on, every rank appends plain tuples to a list of its own: the steps Keras runs
(main thread), how long each collective blocks the thread that called it, each collective
the worker thread issues, each gradient bucket's hand-over and reduction, and saves. At the
end of every `fit`, and at the end of the program, the ranks send their new events to the
master in one collective on the worker (so in the fixed order of all collectives), and the
master rewrites FILE: one trace in Chrome's trace-event format (Perfetto, chrome://tracing),
one process row per rank. After `fit` it also prints a table per rank (`report`).

Clocks: at start-up the master exchanges a few ping-pongs with every rank through the worker
and keeps, per rank, the offset seen with the shortest round trip. The trace moves every
rank's events onto the master's clock and states the offsets in its `otherData`.

Matching: the worker issues the same collectives in the same order on every rank, so the
n-th one recorded on a rank is the n-th on every other. A rank waits in it for the others
from its own arrival to the latest arrival; only the part of that wait during which its
caller was blocked (not hidden behind compute) counts as waiting for the slowest rank.

Off (the default), `recorder` is None and every hook is one test of it.
"""

import bisect
import contextlib
import itertools
import json
import os
import statistics
import threading
import time

import numpy as np

from tarantella.runtime import events as runtime_events
from tarantella.runtime.kinds import Collective

recorder = None  # the Recorder while the timeline is on

_PING_PONGS = 8
_CLOCK_TAG = 7301
MAIN_ROW, OPS_ROW, WORKER_ROW = 1, 2, 3
_ROW_NAMES = {MAIN_ROW: "main thread: steps, callbacks, saves",
              OPS_ROW: "step's collective calls (TensorFlow ops)", WORKER_ROW: "collectives worker"}
# A straggler is named when this share of the other ranks' waiting was for it (in the steps it
# was the slowest in), and they wait at least _STRAGGLER_WAIT of their step.
_STRAGGLER_BLAME = 0.75
_STRAGGLER_WAIT = 0.05
_NOTABLE = 0.10  # input wait or unhidden communication above this share of the step gets advice
_SMALL_BUCKET_BYTES = 1 << 20


def start(comm, path):
    """On every rank, once the communicator exists: compares the clocks, then starts recording."""
    global recorder
    clock = comm.run("the timeline's clock comparison", lambda mpi_comm: _compare_clocks(mpi_comm, comm.size),
                     kind=Collective.TIMELINE)
    recorder = Recorder(comm, os.path.abspath(path), *clock)
    runtime_events.subscribe(recorder)
    import atexit
    # Registered after the communicator's own exit handler, so it runs first, while the ranks still talk.
    atexit.register(_write_at_exit, comm)


def _compare_clocks(mpi_comm, size):
    """Runs on the worker. Returns (offsets, round trips, origin, hosts): per rank, its clock minus the
    master's in ns (from the ping-pong with the shortest round trip), and the master's clock at the end."""
    rank = mpi_comm.Get_rank()
    stamp = np.zeros(1, np.int64)
    measured = np.zeros((size, 2), np.int64)
    for peer in range(1, size):
        if rank == 0:
            best = None
            for _ in range(_PING_PONGS):
                sent = time.perf_counter_ns()
                mpi_comm.Send(stamp, dest=peer, tag=_CLOCK_TAG)
                mpi_comm.Recv(stamp, source=peer, tag=_CLOCK_TAG)
                received = time.perf_counter_ns()
                if best is None or received - sent < best[1]:
                    best = (int(stamp[0]) - (sent + received) // 2, received - sent)
            measured[peer] = best
        elif rank == peer:
            for _ in range(_PING_PONGS):
                mpi_comm.Recv(stamp, source=0, tag=_CLOCK_TAG)
                stamp[0] = time.perf_counter_ns()
                mpi_comm.Send(stamp, dest=0, tag=_CLOCK_TAG)
    origin = np.array([time.perf_counter_ns()], np.int64)
    mpi_comm.Bcast(measured, root=0)
    mpi_comm.Bcast(origin, root=0)
    import socket
    hosts = mpi_comm.allgather(socket.gethostname())
    return measured[:, 0].tolist(), measured[:, 1].tolist(), int(origin[0]), hosts


class Recorder:
    """This rank's events, as tuples whose first item names their kind:
    ("step", kind, start, end, first)               a call of Keras' train or test function (main thread);
                                                    the first call traces the step
    ("blocked", row, kind, what, start, end)        a caller waiting for a collective
    ("collective", sequence, kind, what, start, end) a synchronous collective, on the worker
                                                    (kind: the name of its runtime.kinds.Collective)
    ("bucket", sequence, index, bytes, start, end)  one gradient bucket's reduction, on the worker
    ("handover", index, time)                       TensorFlow handing a bucket to the worker
    ("input", time)                                 a training step's batch arrived (steps that
                                                    open in their gradient round; others open
                                                    with a collective of their own right then)
    ("span", name, start, end)                      a save (main thread)
    Times are this rank's time.perf_counter_ns()."""

    def __init__(self, comm, path, offsets, round_trips, origin, hosts):
        self.path = path
        self.rank, self.size = comm.rank, comm.size
        self.offsets, self.round_trips, self.origin, self.hosts = offsets, round_trips, origin, hosts
        self.now = time.perf_counter_ns
        self.events = []
        self._sequence = 0  # collectives the worker issued since recording began: the same count on every rank
        self._main_thread = threading.main_thread().ident
        self._trace = []  # the master's: every Chrome event written so far
        # perf_counter_ns minus time_ns: puts TensorFlow's tf.timestamp() on this rank's clock.
        self._wall_to_counter = self.now() - time.time_ns()
        self._last_arrival = None

    # -- hooks (off: never called) ----------------------------------------------------------

    def run_collective(self, kind, what, body):
        """On the worker: runs one synchronous collective of `kind` and records it."""
        sequence, self._sequence = self._sequence, self._sequence + 1
        started = self.now()
        try:
            return body()
        finally:
            self.events.append(("collective", sequence, kind.name, what, started, self.now()))

    def caller_waited(self, kind, what, started):
        row = MAIN_ROW if threading.get_ident() == self._main_thread else OPS_ROW
        self.events.append(("blocked", row, kind.name, what, started, self.now()))

    def timed_buckets(self, reduce):
        """`reduce` of one bucket, recording each (called in plan order on the worker)."""
        index = itertools.count()

        def timed(bucket):
            sequence, self._sequence = self._sequence, self._sequence + 1
            started = self.now()
            result = reduce(bucket)
            nbytes = sum(a.nbytes for a in bucket) if isinstance(bucket, tuple) else bucket.nbytes
            self.events.append(("bucket", sequence, next(index), nbytes, started, self.now()))
            return result

        return timed

    def handed_over(self, index):
        self.events.append(("handover", index, self.now()))

    def input_arrived(self, timestamp_s):
        """A batch's arrival, read in the step with tf.timestamp(); every bucket of the step
        hands the same one over, recorded once."""
        if timestamp_s != self._last_arrival:
            self._last_arrival = timestamp_s
            self.events.append(("input", int(timestamp_s * 1e9) + self._wall_to_counter))

    def timed_steps(self, function, kind):
        """Keras' train or test function, each call recorded as a step."""
        calls = itertools.count()

        def timed(*args, **kwargs):
            started = self.now()
            try:
                return function(*args, **kwargs)
            finally:
                self.events.append(("step", kind, started, self.now(), next(calls) == 0))
        return timed

    def fit_ended(self, comm):
        """At the end of a fit: the events so far reach the file, and the master prints the step report."""
        self.write(comm, report=True)

    @contextlib.contextmanager
    def span(self, name):
        started = self.now()
        try:
            yield
        finally:
            self.events.append(("span", name, started, self.now()))

    # -- writing ----------------------------------------------------------------------------

    def write(self, comm, report=False):
        """On every rank: sends the new events to the master, which rewrites the trace file and,
        with `report`, prints the step report of these events."""
        events, self.events = self.events, []
        gathered = comm.run("the timeline gathering",
                            lambda mpi_comm: mpi_comm.gather(events, root=0) if self.size > 1 else [events],
                            kind=Collective.TIMELINE)
        if self.rank != 0:
            return
        self._trace += chrome_events(gathered, self.offsets, self.origin)
        partial = f"{self.path}.partial-{os.getpid()}"
        with open(partial, "w") as file:
            json.dump({"traceEvents": self._row_names() + self._trace, "displayTimeUnit": "ms",
                       "otherData": self._metadata()}, file)
        os.replace(partial, self.path)
        if report:
            from tarantella.common import config
            text = step_report(gathered, self.offsets, self.hosts, config.fusion_threshold_bytes())
            if text:
                print(text + f"\nTrace: {self.path} (open it in https://ui.perfetto.dev or chrome://tracing)",
                      flush=True)

    def _row_names(self):
        names = []
        for rank in range(self.size):
            names.append({"ph": "M", "name": "process_name", "pid": rank,
                          "args": {"name": f"rank {rank} ({self.hosts[rank]})"}})
            names.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for row, name in _ROW_NAMES.items():
                names.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": row, "args": {"name": name}})
                names.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": row,
                              "args": {"sort_index": row}})
        return names

    def _metadata(self):
        from tarantella import __version__
        return {"tarantella": __version__, "ranks": self.size, "hosts": self.hosts,
                "clock": ("each rank's time.perf_counter_ns, moved onto the master's clock: rank r's time minus "
                          f"clock_offsets_us[r]; offsets from {_PING_PONGS} ping-pongs per rank at start-up "
                          "through the collectives worker, the one with the shortest round trip kept; 0 is the "
                          "master's time when the comparison ended"),
                "clock_offsets_us": [offset / 1e3 for offset in self.offsets],
                "clock_round_trips_us": [trip / 1e3 for trip in self.round_trips]}


def _write_at_exit(comm):
    """Events recorded after the last fit (custom loops, evaluate, saves) reach the file too,
    unless a failed collective left the ranks out of step."""
    if recorder is not None and comm.broken is None:
        recorder.write(comm)


# -- from events to the trace -----------------------------------------------------------------

def kind_of(kind, what):
    """(short name, category) of a collective of `kind` (a Collective's name) described as `what`."""
    collective = Collective[kind]
    return collective.named(what), collective.category


def _arrivals(by_rank, offsets):
    """{sequence: (latest arrival on the master's clock, rank that arrived last)} of the worker's collectives."""
    latest = {}
    for rank, events in enumerate(by_rank):
        for event in events:
            if event[0] in ("collective", "bucket"):
                arrival = event[-2] - offsets[rank]
                if event[1] not in latest or arrival > latest[event[1]][0]:
                    latest[event[1]] = (arrival, rank)
    return latest


def chrome_events(by_rank, offsets, origin):
    """Chrome trace events ("X" slices, "i" instants; times in us on the master's clock) of
    every rank's events, with each worker collective split into waiting for the latest rank and
    transfer."""
    latest = _arrivals(by_rank, offsets)
    out = []
    for rank, events in enumerate(by_rank):
        def us(t):
            return (t - offsets[rank] - origin) / 1e3

        def add(name, category, row, start, end, **args):
            out.append({"name": name, "cat": category, "ph": "X", "pid": rank, "tid": row, "ts": us(start),
                        "dur": max(0.0, (end - start) / 1e3), "args": args})

        arrivals = _input_arrivals(events)
        steps = sorted((e for e in events if e[0] == "step"), key=lambda e: e[2])
        counts = {}
        for number, (_, kind, start, end, first) in enumerate(steps):
            counts[kind] = counts.get(kind, 0) + 1
            add(f"{kind} {counts[kind]}" + " (traces the step)" * first, "step", MAIN_ROW, start, end)
            arrived = _first_within(arrivals, start, end)
            if arrived is not None:
                add("waiting for input", "input", MAIN_ROW, start, arrived)
            if number + 1 < len(steps):
                add("callbacks and Keras' loop", "callbacks", MAIN_ROW, end, steps[number + 1][2])
        for event in events:
            if event[0] == "blocked":
                _, row, kind, what, start, end = event
                name, category = kind_of(kind, what)
                add(name, category, row, start, end, what=what)
            elif event[0] in ("collective", "bucket"):
                if event[0] == "collective":
                    _, sequence, kind, what, start, end = event
                    name, category = kind_of(kind, what)
                    args = {"what": what}
                else:
                    _, sequence, index, nbytes, start, end = event
                    name, category, args = f"bucket {index}", "gradients", {"bytes": nbytes, "bucket": index}
                arrival, last = latest[sequence]
                ready = max(start, arrival + offsets[rank])
                add(name, category, WORKER_ROW, start, end, collective=sequence, **args)
                if ready > start:
                    add(f"waiting for rank {last}", "waiting", WORKER_ROW, start, ready)
                add("transfer", "transfer", WORKER_ROW, ready, end)
            elif event[0] == "handover":
                out.append({"name": f"hand-over of bucket {event[1]}", "cat": "gradients", "ph": "i", "s": "t",
                            "pid": rank, "tid": OPS_ROW, "ts": us(event[2])})
            elif event[0] == "span":
                add(event[1], "save", MAIN_ROW, event[2], event[3])
    return out


# -- the step report --------------------------------------------------------------------------

def _input_arrivals(events):
    """Sorted times at which steps had their batch: recorded arrivals, and the start of each
    step opening's collective (it waits for the batch, and nothing else does before it)."""
    return sorted([e[1] for e in events if e[0] == "input"] +
                  [e[4] for e in events if e[0] == "blocked" and e[2] == Collective.STEP_OPENING.name])


def _first_within(times, low, high):
    first = bisect.bisect_left(times, low)
    return times[first] if first < len(times) and times[first] <= high else None


def _overlap(intervals, starts, low, high):
    """Total length of the sorted, disjoint `intervals` (with their `starts`) inside [low, high]."""
    total = 0
    for position in range(max(0, bisect.bisect_right(starts, low) - 1), len(intervals)):
        start, end = intervals[position]
        if start >= high:
            break
        total += max(0, min(end, high) - max(start, low))
    return total


def step_breakdown(by_rank, offsets):
    """Per rank, a list with one dict per training step: ms of the step, of compute, input wait,
    communication not hidden by compute (per category too), and waiting for the slowest rank;
    bucket bytes and count."""
    latest = _arrivals(by_rank, offsets)
    result = []
    for rank, events in enumerate(by_rank):
        waits = sorted((e[-2], latest[e[1]][0] + offsets[rank]) for e in events
                       if e[0] in ("collective", "bucket") and latest[e[1]][0] + offsets[rank] > e[-2])
        wait_starts = [start for start, _ in waits]
        blocked = sorted((e[4], e[5], kind_of(e[2], e[3])[1]) for e in events if e[0] == "blocked")
        blocked_starts = [start for start, _, _ in blocked]
        buckets = sorted((e[4], e[3]) for e in events if e[0] == "bucket")
        bucket_starts = [start for start, _ in buckets]
        arrivals = _input_arrivals(events)
        steps = []
        # A training function's first call traces the step: not a step like the others.
        for event in sorted(e for e in events if e[0] == "step" and e[1] == "training step" and not e[4]):
            _, _, start, end, _ = event
            arrived = _first_within(arrivals, start, end)
            row = {"step": end - start, "input": 0 if arrived is None else arrived - start, "waiting": 0,
                   "unhidden": 0, "by_category": {}}
            for position in range(bisect.bisect_left(blocked_starts, start), len(blocked)):
                block_start, block_end, category = blocked[position]
                if block_start > end:
                    break
                length = min(block_end, end) - block_start
                waited = _overlap(waits, wait_starts, block_start, min(block_end, end))
                row["waiting"] += waited
                row["unhidden"] += length - waited
                row["by_category"][category] = row["by_category"].get(category, 0) + length - waited
            row["compute"] = row["step"] - row["input"] - row["waiting"] - row["unhidden"]
            inside = buckets[bisect.bisect_left(bucket_starts, start):bisect.bisect_right(bucket_starts, end)]
            row["bucket_bytes"] = [nbytes for _, nbytes in inside]
            steps.append(row)
        result.append(steps)
    return result


def step_report(by_rank, offsets, hosts, fusion_threshold_bytes=None):
    """The table printed after fit: per rank, ms per step and % of the step; the straggler, if one
    rank holds the others up consistently; one line on what would help. None without training steps."""
    breakdown = step_breakdown(by_rank, offsets)
    counts = {len(steps) for steps in breakdown}
    if not counts or 0 in counts:
        return None
    steps = min(counts)
    columns = [("compute", "compute"), ("input", "input wait"), ("unhidden", "communication not hidden"),
               ("waiting", "waiting for the slowest rank")]
    means = [{key: statistics.fmean(row[key] for row in rows[:steps]) / 1e6 for key in
              ("step", "compute", "input", "unhidden", "waiting")} for rows in breakdown]
    lines = [f"tarantella timeline: {steps} training steps on {len(breakdown)} rank(s) (the first, which traces, "
             "left out); ms per step (% of the step)",
             f"{'rank':<6}{'step':>9}" + "".join(f"  {title:>{max(len(title), 14)}}" for _, title in columns)]
    for rank, mean in enumerate(means):
        cells = [_ms_and_share(mean[key], mean["step"]).rjust(max(len(title), 14)) for key, title in columns]
        lines.append(f"{rank:<6}{mean['step']:>9.2f}  " + "  ".join(cells))
    straggler = _straggler(breakdown, steps, means)
    if straggler is not None:
        rank, blame, others_wait = straggler
        lines.append(f"Straggler: rank {rank} (host {hosts[rank]}): {blame:.0%} of the other ranks' waiting was for "
                     f"it, {others_wait:.2f} ms per step.")
    lines.append("What would help: " + _advice(breakdown, steps, means, straggler, hosts, fusion_threshold_bytes))
    return "\n".join(lines)


def _ms_and_share(ms, step_ms):
    return f"{ms:.2f} ({ms / step_ms * 100:.0f}%)" if step_ms else "-"


def _straggler(breakdown, steps, means):
    """(rank, share of the others' waiting that was for it, the others' mean wait in ms) or None.

    In each step the slowest rank is the one that spent longest without waiting for another;
    the other ranks' waiting in that step is put down to it."""
    ranks = len(breakdown)
    if ranks < 2:
        return None
    blame = [0.0] * ranks
    for k in range(steps):
        slowest = max(range(ranks), key=lambda r: breakdown[r][k]["step"] - breakdown[r][k]["waiting"])
        blame[slowest] += sum(breakdown[r][k]["waiting"] for r in range(ranks) if r != slowest) / (ranks - 1)
    rank = max(range(ranks), key=blame.__getitem__)
    others = [mean for r, mean in enumerate(means) if r != rank]
    others_wait = statistics.fmean(mean["waiting"] for mean in others)
    others_step = statistics.fmean(mean["step"] for mean in others)
    share = blame[rank] / sum(blame) if sum(blame) else 0.0
    if share >= _STRAGGLER_BLAME and others_step and others_wait / others_step >= _STRAGGLER_WAIT:
        return rank, share, others_wait
    return None


def _advice(breakdown, steps, means, straggler, hosts, fusion_threshold_bytes):
    step = statistics.fmean(mean["step"] for mean in means)
    if straggler is not None:
        rank = straggler[0]
        others = [mean for r, mean in enumerate(means) if r != rank]
        extra_input = means[rank]["input"] - statistics.median(m["input"] for m in others)
        extra_compute = means[rank]["compute"] - statistics.median(m["compute"] for m in others)
        if extra_input >= extra_compute:
            return (f"rank {rank}'s input pipeline: it waits {means[rank]['input']:.2f} ms per step for input, the "
                    f"others {statistics.median(m['input'] for m in others):.2f} ms. Speed up its tf.data pipeline "
                    "(map(..., num_parallel_calls=tf.data.AUTOTUNE), prefetch, cache) or its storage.")
        return (f"a slow host: rank {rank} computes {extra_compute:.2f} ms per step longer than the others. Check "
                f"what else runs on {hosts[rank]}, and how the ranks are bound to cores (--pin-to-socket).")
    input_wait = statistics.fmean(mean["input"] for mean in means)
    if step and input_wait / step >= _NOTABLE:
        return (f"the input pipeline: the ranks wait {input_wait:.2f} ms per step for input "
                "(map(..., num_parallel_calls=tf.data.AUTOTUNE), prefetch, cache).")
    unhidden = statistics.fmean(mean["unhidden"] for mean in means)
    if not step or unhidden / step < _NOTABLE:
        return f"nothing stands out: compute is {statistics.fmean(m['compute'] for m in means) / step:.0%} of the step."
    by_category = {}
    for rows in breakdown:
        for row in rows[:steps]:
            for category, value in row["by_category"].items():
                by_category[category] = by_category.get(category, 0) + value / 1e6 / steps / len(breakdown)
    if by_category.get("batchnorm", 0) >= unhidden / 2:
        return (f"fewer synchronized BatchNormalization layers: their collectives leave {by_category['batchnorm']:.2f} "
                "ms per step unhidden (tnt.Model(..., synchronized_batch_normalization=False), or synchronize "
                "only some layers: layer.synchronized = True).")
    sizes = [nbytes for rows in breakdown for row in rows[:steps] for nbytes in row["bucket_bytes"]]
    per_step = len(sizes) / steps / len(breakdown)
    if sizes and per_step > 4 and statistics.median(sizes) < _SMALL_BUCKET_BYTES:
        now = "" if fusion_threshold_bytes is None else f", now {fusion_threshold_bytes / 1024:g} KB"
        return (f"a higher fusion threshold (--fusion-threshold KB or TNT_FUSION_THRESHOLD{now}): {per_step:.0f} "
                f"gradient buckets per step, of {statistics.median(sizes) / 1024:.0f} KB (median), leave "
                f"{unhidden:.2f} ms per step unhidden.")
    return (f"little on tarantella's side: {unhidden:.2f} ms per step of communication ({sum(sizes) / steps / len(breakdown) / 1e6:.1f} "
            "MB of gradients) is not hidden by compute; a larger micro-batch hides more of it.")
