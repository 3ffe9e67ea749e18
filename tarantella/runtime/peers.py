"""The peer monitor: every rank serves a second communicator on a thread of its own, answers the
other ranks' "what are you doing?", and learns which ranks have finished or failed."""

import threading
import time

from tarantella.runtime.errors import SAVE_HINT, RankFailedError, RankLeftError, with_call

_QUERY_WAIT_S = 1.0


class PeerMonitor:
    """Serves the second communicator: answers the other ranks' "what are you doing?" and
    learns which ranks have finished the program.

    It polls (non-blocking probes, a few times a second) instead of blocking in MPI, whose
    waiting spins and would take a core from the training.
    """

    _ASK, _ANSWER, _FINISHED, _FAILED = 1, 2, 3, 4
    _POLL_S = 0.05

    def __init__(self, side_comm, communicator):
        self._side = side_comm
        self._comm = communicator
        self._finished = {}  # rank -> its (entered, current, last, host) when it finished
        self._failures = {}  # rank -> what failed there, as it told us
        self._answers = {}
        self._changed = threading.Condition()
        self._sending = []
        self._sending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tarantella-peers", daemon=True)
        self._thread.start()

    def _state(self):
        comm = self._comm
        current = comm.current
        return comm.entered, None if current is None else with_call(current), comm.last, comm.host

    def _send(self, rank, tag, message):
        request = self._side.isend(message, dest=rank, tag=tag)
        with self._sending_lock:
            self._sending.append(request)

    def _serve(self):
        from mpi4py import MPI
        status = MPI.Status()
        while not self._stop.is_set():
            while self._side.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                source, tag = status.Get_source(), status.Get_tag()
                message = self._side.recv(source=source, tag=tag)
                if tag == self._ASK:
                    self._send(source, self._ANSWER, self._state())
                with self._changed:
                    if tag == self._ANSWER:
                        self._answers[source] = message
                    elif tag == self._FINISHED:
                        self._finished[source] = message
                    elif tag == self._FAILED:
                        self._failures[source] = message
                    self._changed.notify_all()
            with self._sending_lock:
                self._sending = [request for request in self._sending if not request.Test()]
            self._stop.wait(self._POLL_S)

    def ask_everyone(self):
        """{rank: (collectives entered, current one or None, the one before, host)} of the ranks
        that answer within a second; finished ranks answer with their state at the end."""
        others = [rank for rank in range(self._comm.size) if rank != self._comm.rank]
        with self._changed:
            self._answers = {}
        for rank in others:
            if rank not in self._finished:
                self._send(rank, self._ASK, None)
        with self._changed:
            self._changed.wait_for(lambda: all(r in self._answers or r in self._finished for r in others),
                                   _QUERY_WAIT_S)
            return {**self._answers, **self._finished}

    def raise_if_needed_rank_left(self, what):
        """Raises RankLeftError when a rank finished the program before entering this collective."""
        with self._changed:
            gone = sorted((rank, state) for rank, state in self._finished.items() if state[0] < self._comm.entered)
        if not gone:
            return
        what = with_call(what)
        rank, (entered, _, last, host) = gone[0]
        summary = (f"rank {rank} on host {host} left early: it finished the program after collective "
                   f"#{entered} ({last}) while rank {self._comm.rank} waited for it in {what} "
                   f"(#{self._comm.entered})")
        raise RankLeftError(
            f"rank {self._comm.rank}: {summary}. Every rank must run the same collectives: a rank may "
            "end only when the others need it no more." + SAVE_HINT * ("save" in what), summary=summary,
            culprit=rank)

    def raise_if_a_rank_failed(self):
        """Raises RankFailedError when another rank told this one that it failed."""
        with self._changed:
            failures = sorted(self._failures.items())
        if failures:
            rank, failure = failures[0]
            raise RankFailedError(f"rank {self._comm.rank}: {failure}. The job stops.", summary=failure,
                                  culprit=rank)

    def announce_failure(self, failure):
        """Tells every other rank that this one failed (`failure` says how), so that they raise it
        at their next collective instead of waiting there for the timeout."""
        for rank in range(self._comm.size):
            if rank != self._comm.rank:
                self._send(rank, self._FAILED, failure)
        self._wait_until_sent()

    def _wait_until_sent(self):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # small messages: done at once unless a rank is gone
            with self._sending_lock:
                if all(request.Test() for request in self._sending):
                    break
            time.sleep(0.01)

    def announce_finished(self):
        """Tells every rank that this one has finished the program; then stops serving."""
        state = self._state()
        for rank in range(self._comm.size):
            if rank != self._comm.rank:
                self._send(rank, self._FINISHED, state)
        self._wait_until_sent()
        self._stop.set()
        self._thread.join()

