"""The communicator: one MPI communicator and the worker thread that issues its collectives.

One worker thread issues every collective of the process, one at a time: synchronous calls in
program order, the gradient buckets of a step in the order of a static plan (while backprop goes
on, see `reducer`). So collectives never race, whatever order a framework runs its ops in.

Before each collective the ranks agree on it (a 32-byte allreduce of a code of the operation), so
ranks that enter different collectives get an error naming both, never a mismatched buffer in
MPI. A training or test step agrees once, on its whole sequence of collectives, in the message
that also sums the ranks' micro-batch sizes: the step's opening, or, where nothing before
backprop needs the global batch size, the first message of its gradient round.

The caller waits in short slices and meanwhile watches the other ranks through the peer monitor
(`peers`): it learns at once that a rank it waits for has finished the program, asks the missing
ranks what they are doing for the stall warning and the timeout, and gives up without waiting
for MPI.
"""

import hashlib
import queue
import socket
import sys
import threading
import time

import numpy as np

from tarantella.runtime import events
from tarantella.runtime.errors import (SAVE_HINT, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError,
                                       first_failure, remember, with_call)
from tarantella.runtime.kinds import Collective, kind_and_words
from tarantella.runtime.peers import PeerMonitor

MASTER_RANK = 0
# A waiting caller looks at the other ranks this often; a collective that completes wakes it at once.
_CHECK_EVERY_S = 0.05


class Communicator:
    """One MPI communicator and the worker thread that issues its collectives.

    Args:
        mpi: the MPI module (mpi4py's, or the serial stand-in of `runtime.serial`).
        mpi_comm: the communicator the collectives run on, this object's own.
        timeout_s: how long a caller waits for the other ranks before it fails.
        side_comm: a second communicator for the peer monitor (None on one rank).
        stall_warning_s: when a waiting caller warns about the ranks it waits for (None: never).
    """

    def __init__(self, mpi, mpi_comm, timeout_s, side_comm=None, stall_warning_s=None):
        self.MPI = mpi
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.timeout_s = timeout_s
        self.stall_warning_s = stall_warning_s
        self.host = socket.gethostname()
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._work, name="tarantella-collectives", daemon=True).start()
        # What this rank does, for the other ranks' questions: collectives entered, the one it
        # waits in (None between collectives) and the one before.
        self.entered = 0
        self.agreements = 0  # of the collectives entered, those that opened with an agreement
        self.compared_alike = None  # what the last collective's opening found (see run)
        self.current = None
        self.last = None
        self._broken = None  # the error after which this communicator cannot be used
        # The cluster's warning signal reached this rank (set by the signal's handler), and some
        # rank's request has ridden in an agreement message: every rank learns it in the same one.
        self.stop_wanted = False
        self.stop_agreed = False
        self.peers = PeerMonitor(side_comm, self) if side_comm is not None and self.size > 1 else None
        # Agreement codes stay below this, so that size * code^2 fits in an int64.
        self._code_limit = 2 ** ((62 - self.size.bit_length()) // 2)

    # -- the worker -------------------------------------------------------------

    def _work(self):
        while True:
            self._jobs.get()()

    def submit_job(self, job):
        """Queues `job()` for the worker, after every job queued before it."""
        self._jobs.put(job)

    @property
    def broken(self):
        """Why this communicator cannot be used any more (the ranks are out of step), or None."""
        return self._broken

    def run(self, what, operation, agree_on=None, agreed=False, compare=None, kind=None):
        """Runs `operation(mpi_comm)` on the worker, after any gradient round; bounded wait.

        `what` names the collective: a `Collective`, or the caller's words (with `kind`, the
        `Collective` they belong to; default OTHER). First the ranks agree that they all run
        `agree_on` (default: the words) of that kind, unless `agreed`:
        the opening of the step this collective belongs to covered it. With `compare` (a string,
        e.g. the call's shapes), the same message also finds whether every rank passed the same
        one: `operation` reads `compared_alike` (True, False, or None where nothing was compared)."""
        kind, what = kind_and_words(what, kind)
        agree_on = None if agreed else (what if agree_on is None else agree_on)

        def body():
            self.enter(what, agree_on, compare=compare, kind=kind)
            return operation(self.mpi_comm)

        return self._on_worker(kind, what, body)

    def open_step(self, what, sequence, samples):
        """Agrees on a step's `sequence` of collectives and returns the sum of `samples` over ranks."""
        opening = Collective.STEP_OPENING
        return self._on_worker(opening, what, lambda: self.enter(what, sequence, carried=samples, kind=opening))

    def _on_worker(self, kind, what, body):
        self.refuse_if_broken(what)
        outcome = {}
        done = threading.Event()
        recorder = events.observer

        def job():
            try:
                outcome["value"] = body() if recorder is None else recorder.run_collective(kind, what, body)
            except BaseException as error:
                outcome["error"] = error
            finally:
                self.leave()
                done.set()

        called = recorder and recorder.now()
        self._jobs.put(job)
        self.wait_watching(done.wait, what)
        if recorder is not None:
            recorder.caller_waited(kind, what, called)
        if "error" in outcome:
            raise remember(outcome["error"])
        return outcome.get("value")

    def refuse_if_broken(self, what):
        if self._broken is not None:
            raise remember(CollectiveError(
                f"rank {self.rank}: {what} cannot start: an earlier collective failed ({self._broken}), so "
                "the ranks are out of step. End the program.", summary=self._broken,
                culprit=getattr(first_failure(), "culprit", None)))

    def wait_watching(self, finished, what):
        """Waits for `finished(timeout)` to return True, watching the other ranks meanwhile.

        Gives up when a rank this one waits for has finished the program, or after the
        timeout; warns once about a stall. (The worker may stay blocked in MPI: the
        communicator is then unusable, and the job is meant to end.)"""
        started = time.monotonic()
        warned = False
        while not finished(_CHECK_EVERY_S):
            waited = time.monotonic() - started
            try:
                if self.peers is not None:
                    self.peers.raise_if_a_rank_failed()
                    self.peers.raise_if_needed_rank_left(self.current or what)
                if self.stall_warning_s is not None and not warned and waited >= self.stall_warning_s:
                    warned = True
                    self._warn_stall(with_call(self.current or what), waited)
                if waited >= self.timeout_s:
                    raise self._missing_ranks_error(with_call(self.current or what))
            except CollectiveError as error:
                self._broken = error.summary or str(error)
                raise remember(error)

    # -- the agreement before each collective (runs on the worker) ------------------------

    def enter(self, what, agree_on, carried=0, compare=None, kind=Collective.OTHER):
        """Waits until every rank enters a collective; raises if they entered different ones.

        The ranks agree on `agree_on` of `kind` (a Collective). Returns the sum over ranks of the
        integer `carried`, which rides in the same message, as do the comparison of `compare`
        (see `run`) and whether any rank wants to save and stop (`stop_agreed` is set on all). With `agree_on` None it only notes the collective: a step's opening agreed
        on it."""
        self.current = what
        self.entered += 1
        self.compared_alike = True if self.size == 1 and compare is not None else None
        if self.size == 1:
            self.stop_agreed = self.stop_agreed or self.stop_wanted
        if self.size == 1 or agree_on is None:
            return carried
        self.agreements += 1
        code = self._code(f"{kind.name}: {agree_on}")
        # Every collective opens with this one message, so ranks in different collectives still
        # meet. The sums of code and code^2 are size*code and size*code^2 only if every rank sent
        # this code (their variance is then zero); exact in int64 for codes below _code_limit.
        compared = [] if compare is None else [self._code(compare), self._code(compare) ** 2]
        message = np.array([code, code * code, carried, int(self.stop_wanted)] + compared, np.int64)
        self.mpi_comm.Allreduce(self.MPI.IN_PLACE, message, op=self.MPI.SUM)
        if message[0] != self.size * code or message[1] != self.size * code * code:
            everyone = self.mpi_comm.allgather((with_call(what), agree_on))
            listing = "; ".join(f"rank {rank}: {doing}" for rank, (doing, _) in enumerate(everyone))
            if len({doing for doing, _ in everyone}) == 1:  # the same step, with different collectives
                listing += " (" + "; ".join(f"rank {rank}: {sequence}" for rank, (_, sequence) in
                                            enumerate(everyone)) + ")"
            error = CollectiveMismatchError(
                f"rank {self.rank}: the ranks entered different collectives (collective #{self.entered}): "
                f"{listing}. Every rank must call fit, evaluate, predict and save alike, in the same "
                "order, with the same epochs and steps." + SAVE_HINT * ("save" in listing),
                summary=f"the ranks entered different collectives: {listing}")
            self._broken = error.summary
            raise error
        if compare is not None:
            self.compared_alike = bool(message[4] == self.size * compared[0] and message[5] == self.size * compared[1])
        self.stop_agreed = self.stop_agreed or bool(message[3])
        return int(message[2])

    def _code(self, text):
        """A number for `text` in 1.._code_limit (about 30 bits for up to a thousand ranks)."""
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        return digest % self._code_limit + 1

    def leave(self):
        if self.current is not None:
            self.last, self.current = self.current, None

    def _describe_missing(self, what):
        """[(rank, description)] of the ranks that are not in this collective, after asking them."""
        answers = self.peers.ask_everyone() if self.peers is not None else {}
        missing = []
        for rank in range(self.size):
            if rank == self.rank:
                continue
            answer = answers.get(rank)
            if answer is None:
                missing.append((rank, f"rank {rank} did not answer (stopped, or stuck outside Python); it "
                                      f"took part in collective #{self.entered - 1} ({self.last})"))
                continue
            entered, current, last, host = answer
            if entered == self.entered and current is not None:
                continue  # it is here
            doing = (f"is in {current} (collective #{entered})" if current is not None else
                     f"is not in a collective; its last was {last} (#{entered})")
            missing.append((rank, f"rank {rank} on host {host} {doing}"))
        return missing

    def _warn_stall(self, what, waited):
        missing = self._describe_missing(what)
        waiting = [rank for rank in range(self.size) if rank not in dict(missing)]
        if not missing or min(waiting) != self.rank:
            return  # one warning per stall: the waiting rank with the lowest number writes it
        sys.stderr.write(
            f"tarantella: WARNING: rank {self.rank} has waited {waited:.0f} s in {what} (collective "
            f"#{self.entered}) for {len(missing)} rank(s): " + "; ".join(text for _, text in missing)
            + f". The job fails after TNT_COLLECTIVE_TIMEOUT={self.timeout_s:g} s.\n")
        sys.stderr.flush()

    def _missing_ranks_error(self, what):
        missing = self._describe_missing(what)
        who = "; ".join(text for _, text in missing) or "every rank answered, but the collective did not complete"
        ranks = ", ".join(str(rank) for rank, _ in missing)
        return CollectiveTimeoutError(
            f"rank {self.rank}: {what} (collective #{self.entered}) did not complete within "
            f"{self.timeout_s:g} s: rank(s) {ranks} did not arrive. {who}. A rank has failed, hangs, or "
            "runs different code (other epochs or steps). If a rank legitimately needs longer (e.g. the "
            "master writes a large file), raise TNT_COLLECTIVE_TIMEOUT." + SAVE_HINT * ("save" in what),
            summary=f"rank(s) {ranks} did not arrive at {what} within {self.timeout_s:g} s ({who})",
            culprit=missing[0][0] if missing else None)

    # -- synchronous collectives --------------------------------------------------

    # `what` below, as in `run`: a Collective, or the words of a collective of no fixed kind.

    def allreduce_sum(self, array, what, agreed=False):
        kind, words = kind_and_words(what)
        result = np.array(array, copy=True, order="C")
        self.run(words, lambda comm: comm.Allreduce(self.MPI.IN_PLACE, result, op=self.MPI.SUM),
                 agree_on=f"{words} of {result.dtype}[{result.size}]", agreed=agreed, kind=kind)
        return result

    def allgather(self, obj, what, agree_on=None):
        return self.run(what, lambda comm: comm.allgather(obj), agree_on=agree_on)

    def broadcast_bytes(self, buffer, what, root=MASTER_RANK):
        """Overwrites the uint8 array `buffer` with the root's copy."""
        kind, words = kind_and_words(what)
        self.run(words, lambda comm: comm.Bcast(buffer, root=root), agree_on=f"{words} of {buffer.nbytes} bytes",
                 kind=kind)

    def broadcast_object(self, obj, what):
        """The master's `obj` (any picklable object), on every rank."""
        return self.run(what, lambda comm: comm.bcast(obj, root=MASTER_RANK))

    def allgather_interleaved_rows(self, arrays, what):
        """Gathers row-split arrays back into global order.

        Rank r holds rows r, r+size, r+2*size, ... of each global array (the data
        distribution hands out samples that way), possibly none.
        """
        def gather(comm):
            counts = comm.allgather(arrays[0].shape[0] if arrays else 0)
            gathered = []
            for local in arrays:
                by_rank = _rows_in_rank_order(comm, local, counts)
                interleaved = np.empty_like(by_rank)
                start = 0
                for rank, count in enumerate(counts):
                    interleaved[rank::self.size] = by_rank[start:start + count]
                    start += count
                gathered.append(interleaved)
            return gathered

        return self.run(what, gather)


def allgather_rows(mpi_comm, array):
    """Every rank's rows of `array`, concatenated in rank order (called on the worker)."""
    return _rows_in_rank_order(mpi_comm, array, mpi_comm.allgather(array.shape[0]))


def _rows_in_rank_order(mpi_comm, array, counts):
    """Every rank's rows of `array` (rank r has counts[r] of them), concatenated in rank order."""
    array = np.ascontiguousarray(array)
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    gathered = np.empty((sum(counts),) + array.shape[1:], array.dtype)
    mpi_comm.Allgatherv(array.reshape(-1).view(np.uint8),
                        [gathered.reshape(-1).view(np.uint8), [n * row_bytes for n in counts]])
    return gathered
