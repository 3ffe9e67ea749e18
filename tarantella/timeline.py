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

import contextlib
import itertools
import json
import os
import threading
import time

import numpy as np

from tarantella.runtime import events as runtime_events
from tarantella.runtime.kinds import Collective
from tarantella.timeline_report import MAIN_ROW, OPS_ROW, WORKER_ROW, chrome_events, step_report

recorder = None  # the Recorder while the timeline is on

_PING_PONGS = 8
_CLOCK_TAG = 7301
_ROW_NAMES = {MAIN_ROW: "main thread: steps, callbacks, saves",
              OPS_ROW: "step's collective calls (TensorFlow ops)", WORKER_ROW: "collectives worker"}


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

    def timed_buckets(self, reduce, wire_bytes):
        """`reduce` of one bucket, recording each with its `wire_bytes(bucket)` (called in plan order
        on the worker)."""
        index = itertools.count()

        def timed(bucket):
            sequence, self._sequence = self._sequence, self._sequence + 1
            started = self.now()
            nbytes = wire_bytes(bucket)
            result = reduce(bucket)
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
            from tarantella import backends
            text = step_report(gathered, self.offsets, self.hosts, *backends.fusion_threshold())
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
