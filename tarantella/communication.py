"""Ranks and collectives over MPI (mpi4py).

A program started without an MPI launcher where mpi4py or the MPI library is missing runs as
a single process: a stand-in communicator of one rank, whose collectives return their input.

One worker thread issues every collective of the process, one at a time: synchronous
calls in program order, the gradient buckets of a step in the order of a static plan
(while backprop goes on). So collectives on the communicator never race, whatever order
TensorFlow runs its ops in.

Before each collective the ranks agree on it (a 24-byte allreduce of a code of the
operation), so ranks that enter different collectives get an error naming both, never a
mismatched buffer in MPI. A training or test step agrees once, on its whole sequence of
collectives, in the message that also sums the ranks' micro-batch sizes: the step's opening,
or, where nothing before backprop needs the global batch size, the first message of its
gradient round.

The caller waits in short slices and meanwhile watches the other ranks through a second
communicator, served by a monitor thread on every rank: it learns at once that a rank it
waits for has finished the program, asks the missing ranks what they are doing for the
stall warning and the timeout, and gives up without waiting for MPI.
"""

import atexit
import hashlib
import logging
import os
import queue
import socket
import sys
import threading
import time

import numpy as np

from tarantella import config, timeline

logger = logging.getLogger("tarantella")

MASTER_RANK = 0
_ABORT_GRACE_S = 1.0
_RING_MIN_BYTES = 1 << 20  # below this MPI's own algorithms have the lower latency


class CollectiveError(RuntimeError):
    """The ranks could not complete a collective together. `summary` is one line for the launcher;
    `culprit` is the rank whose failure (or absence) caused this error, when it is another one."""

    def __init__(self, message, summary=None, culprit=None):
        super().__init__(message)
        self.summary = summary
        self.culprit = culprit


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete because another rank did not take part in time."""


class RankLeftError(CollectiveError):
    """A rank finished the program while another one still needed it in a collective."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered different collectives (e.g. one in evaluate, another in fit)."""


class RankFailedError(CollectiveError):
    """Another rank failed in code only it runs (e.g. a master-only callback) and told this one."""


# The first collective error of this process: TensorFlow wraps an error raised inside a step
# in its own UnknownError, and the user should see this one instead.
_first_failure = None
# A waiting caller looks at the other ranks this often; a collective that completes wakes it
# at once.
_CHECK_EVERY_S = 0.05
_QUERY_WAIT_S = 1.0


class _BucketRound:
    """The fused gradient buckets of one training step.

    TensorFlow hands the buckets over in whatever order backprop produces them; the
    worker reduces them strictly in plan order, so every rank issues the same sequence.
    """

    def __init__(self, count):
        self.arrays = [None] * count
        self.reduced = 0
        self.error = None
        self.changed = threading.Condition()
        self._buffers = {}  # address of a dense bucket's memory -> its index
        # Set where the round opens its step (see Communicator.submit_bucket).
        self.global_samples = None
        self._rescale = None

    def open(self, global_samples, divisor):
        """The step's global batch size is known: a rank that divided its loss by another
        `divisor` rescales its buckets before they are summed."""
        self.global_samples = global_samples
        if divisor != global_samples:
            self._rescale = divisor / global_samples

    def _rescaled(self, bucket):
        """Runs where the rank guessed the global batch size wrong (a last incomplete batch):
        its contribution becomes the one weighted by the true share."""
        if self._rescale is None:
            return bucket
        if isinstance(bucket, tuple):  # TensorFlow may share a sparse gradient's values: a new array
            indices, values = bucket
            return indices, values * values.dtype.type(self._rescale)
        bucket *= bucket.dtype.type(self._rescale)  # a dense bucket's buffer is the round's own
        return bucket

    def deposit(self, index, array):
        if isinstance(array, np.ndarray) and array.nbytes:
            address = array.__array_interface__["data"][0]
            earlier = self._buffers.setdefault(address, index)
            if earlier != index:
                # Summed in place twice, the gradients would be wrong; stop instead.
                raise CollectiveError(
                    f"gradient buckets {earlier} and {index} of this step are one buffer: TensorFlow merged "
                    "two equal gradients, and tarantella would sum them over the ranks twice. This is a "
                    "tarantella bug; please report it with your model's layers.")
        with self.changed:
            self.arrays[index] = array
            self.changed.notify_all()

    def reduce_in_plan_order(self, begin, reduce):
        try:
            begin()
            for index in range(len(self.arrays)):
                with self.changed:
                    self.changed.wait_for(lambda: self.arrays[index] is not None)
                result = reduce(self._rescaled(self.arrays[index]))
                with self.changed:
                    self.arrays[index] = result
                    self.reduced += 1
                    self.changed.notify_all()
        except BaseException as error:  # handed to the waiting training step
            with self.changed:
                self.error = error
                self.changed.notify_all()

    def wait(self, timeout_s):
        """True once every bucket is reduced; False after `timeout_s`. Raises the worker's error."""
        with self.changed:
            finished = self.changed.wait_for(
                lambda: self.error is not None or self.reduced == len(self.arrays), timeout_s)
        if self.error is not None:
            raise self.error
        return finished


class Communicator:
    """One MPI communicator and the worker thread that issues its collectives."""

    def __init__(self, mpi_comm, timeout_s, ring_allreduce=True, side_comm=None, stall_warning_s=None):
        self._mpi = mpi_comm
        self._ring_allreduce = ring_allreduce
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.timeout_s = timeout_s
        self.stall_warning_s = stall_warning_s
        self.host = socket.gethostname()
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._work, name="tarantella-collectives", daemon=True).start()
        self._round = None
        self._round_lock = threading.Lock()
        self._scratch = np.empty(0, np.uint8)
        self._steps_reduced = 0
        # What this rank does, for the other ranks' questions: collectives entered, the one it
        # waits in (None between collectives) and the one before.
        self.entered = 0
        self.agreements = 0  # of the collectives entered, those that opened with an agreement
        self.compared_alike = None  # what the last collective's opening found (see run)
        self.global_samples = None  # the global batch size the last collected round carried
        self.current = None
        self.last = None
        self._broken = None  # the error after which this communicator cannot be used
        self.peers = _PeerMonitor(side_comm, self) if side_comm is not None and self.size > 1 else None
        # Agreement codes stay below this, so that size * code^2 fits in an int64.
        self._code_limit = 2 ** ((62 - self.size.bit_length()) // 2)

    # -- the worker -------------------------------------------------------------

    def _work(self):
        while True:
            self._jobs.get()()

    def run(self, what, operation, agree_on=None, agreed=False, compare=None):
        """Runs `operation(mpi_comm)` on the worker, after any gradient round; bounded wait.

        First the ranks agree that they all run `agree_on` (default: `what`), unless `agreed`:
        the opening of the step this collective belongs to covered it. With `compare` (a string,
        e.g. the call's shapes), the same message also finds whether every rank passed the same
        one: `operation` reads `compared_alike` (True, False, or None where nothing was compared)."""
        agree_on = None if agreed else (what if agree_on is None else agree_on)

        def body():
            self.enter(what, agree_on, compare=compare)
            return operation(self._mpi)

        return self._on_worker(what, body)

    def open_step(self, what, sequence, samples):
        """Agrees on a step's `sequence` of collectives and returns the sum of `samples` over ranks."""
        return self._on_worker(what, lambda: self.enter(what, sequence, carried=samples))

    def _on_worker(self, what, body):
        self._refuse_if_broken(what)
        outcome = {}
        done = threading.Event()
        recorder = timeline.recorder

        def job():
            try:
                outcome["value"] = body() if recorder is None else recorder.run_collective(what, body)
            except BaseException as error:
                outcome["error"] = error
            finally:
                self.leave()
                done.set()

        called = recorder and recorder.now()
        self._jobs.put(job)
        self._wait(done.wait, what)
        if recorder is not None:
            recorder.caller_waited(what, called)
        if "error" in outcome:
            raise _remember(outcome["error"])
        return outcome.get("value")

    def _refuse_if_broken(self, what):
        if self._broken is not None:
            raise _remember(CollectiveError(
                f"rank {self.rank}: {what} cannot start: an earlier collective failed ({self._broken}), so "
                "the ranks are out of step. End the program.", summary=self._broken,
                culprit=getattr(_first_failure, "culprit", None)))

    def _wait(self, finished, what):
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
                    self._warn_stall(_with_call(self.current or what), waited)
                if waited >= self.timeout_s:
                    raise self._missing_ranks_error(_with_call(self.current or what))
            except CollectiveError as error:
                self._broken = error.summary or str(error)
                raise _remember(error)

    # -- the agreement before each collective (runs on the worker) ------------------------

    def enter(self, what, agree_on, carried=0, compare=None):
        """Waits until every rank enters a collective; raises if they entered different ones.

        Returns the sum over ranks of the integer `carried`, which rides in the same message, as
        does the comparison of `compare` (see `run`). With `agree_on` None it only notes the
        collective: a step's opening agreed on it."""
        self.current = what
        self.entered += 1
        self.compared_alike = True if self.size == 1 and compare is not None else None
        if self.size == 1 or agree_on is None:
            return carried
        self.agreements += 1
        MPI = mpi()
        code = self._code(agree_on)
        # Every collective opens with this one message, so ranks in different collectives still
        # meet. The sums of code and code^2 are size*code and size*code^2 only if every rank sent
        # this code (their variance is then zero); exact in int64 for codes below _code_limit.
        compared = [] if compare is None else [self._code(compare), self._code(compare) ** 2]
        message = np.array([code, code * code, carried] + compared, np.int64)
        self._mpi.Allreduce(MPI.IN_PLACE, message, op=MPI.SUM)
        if message[0] != self.size * code or message[1] != self.size * code * code:
            everyone = self._mpi.allgather((_with_call(what), agree_on))
            listing = "; ".join(f"rank {rank}: {doing}" for rank, (doing, _) in enumerate(everyone))
            if len({doing for doing, _ in everyone}) == 1:  # the same step, with different collectives
                listing += " (" + "; ".join(f"rank {rank}: {sequence}" for rank, (_, sequence) in
                                            enumerate(everyone)) + ")"
            error = CollectiveMismatchError(
                f"rank {self.rank}: the ranks entered different collectives (collective #{self.entered}): "
                f"{listing}. Every rank must call fit, evaluate, predict and save alike, in the same "
                "order, with the same epochs and steps." + _SAVE_HINT * ("save" in listing),
                summary=f"the ranks entered different collectives: {listing}")
            self._broken = error.summary
            raise error
        if compare is not None:
            self.compared_alike = bool(message[3] == self.size * compared[0] and message[4] == self.size * compared[1])
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
            "master writes a large file), raise TNT_COLLECTIVE_TIMEOUT." + _SAVE_HINT * ("save" in what),
            summary=f"rank(s) {ranks} did not arrive at {what} within {self.timeout_s:g} s ({who})",
            culprit=missing[0][0] if missing else None)

    # -- synchronous collectives --------------------------------------------------

    def allreduce_sum(self, array, what, agreed=False):
        MPI = mpi()
        result = np.array(array, copy=True, order="C")
        self.run(what, lambda comm: comm.Allreduce(MPI.IN_PLACE, result, op=MPI.SUM),
                 agree_on=f"{what} of {result.dtype}[{result.size}]", agreed=agreed)
        return result

    def allgather(self, obj, what, agree_on=None):
        return self.run(what, lambda comm: comm.allgather(obj), agree_on=agree_on)

    def broadcast_bytes(self, buffer, what, root=MASTER_RANK):
        """Overwrites the uint8 array `buffer` with the root's copy."""
        self.run(what, lambda comm: comm.Bcast(buffer, root=root), agree_on=f"{what} of {buffer.nbytes} bytes")

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
                local = np.ascontiguousarray(local)
                row_bytes = local.dtype.itemsize * int(np.prod(local.shape[1:], dtype=np.int64))
                by_rank = np.empty((sum(counts),) + local.shape[1:], local.dtype)
                comm.Allgatherv(local.reshape(-1).view(np.uint8),
                                [by_rank.reshape(-1).view(np.uint8), [n * row_bytes for n in counts]])
                interleaved = np.empty_like(by_rank)
                start = 0
                for rank, count in enumerate(counts):
                    interleaved[rank::self.size] = by_rank[start:start + count]
                    start += count
                gathered.append(interleaved)
            return gathered

        return self.run(what, gather)

    # -- gradient buckets (called from TensorFlow ops) ---------------------------

    def submit_bucket(self, index, count, array, agreed=False, opening=None):
        """Hands over bucket `index` of `count`; returns at once.

        An array is summed over ranks in place; a tuple (indices, values) of a sparse gradient
        is replaced by the concatenation of every rank's, in rank order. With `agreed`, the
        opening of the step agreed on this round.

        With `opening` (sequence, samples, divisor), the round opens its step: its first
        message agrees on the step's `sequence` of collectives (a string) and sums the
        ranks' `samples`, the global batch size B (`collect_buckets` then sets
        `global_samples`). The rank differentiated its loss divided by `divisor`, its guess
        of B; where that was wrong, its in-place buckets are rescaled before they are summed."""
        self._refuse_if_broken("the gradient allreduce")
        with self._round_lock:
            if self._round is None:
                self._round = _BucketRound(count)
                step_round = self._round
                what = f"the gradient allreduce of step {self._steps_reduced + 1}"
                if opening is not None:
                    sequence, samples, divisor = opening
                    begin = lambda: step_round.open(self._open_round(what, sequence, samples), divisor)
                else:
                    agree_on = None if agreed else f"the gradient allreduce of {count} buckets"
                    begin = lambda: self.enter(what, agree_on)
                self._jobs.put(lambda: self._reduce_round(step_round, begin))
            step_round = self._round
        if timeline.recorder is not None:
            timeline.recorder.handed_over(index)
        step_round.deposit(index, array)

    def _open_round(self, what, sequence, samples):
        """The agreement and sum of micro-batch sizes a gradient round opens its step with."""
        if timeline.recorder is None:
            return self.enter(what, sequence, carried=samples)
        return timeline.recorder.run_collective(f"the allreduce of micro-batch sizes that opens {what}",
                                                lambda: self.enter(what, sequence, carried=samples))

    def _reduce_round(self, step_round, begin):
        recorder = timeline.recorder
        reduce = self._reduce_bucket if recorder is None else recorder.timed_buckets(self._reduce_bucket)
        try:
            step_round.reduce_in_plan_order(begin, reduce)
        finally:
            self.leave()

    def _reduce_bucket(self, bucket):
        if isinstance(bucket, tuple):
            return self._reduce_sparse(*bucket)
        self._allreduce_bucket(bucket)
        return bucket

    def _reduce_sparse(self, indices, values):
        """A sparse gradient as a serial step on the global batch would have it.

        Rows looked up per sample (tokens) give every rank different indices: the serial
        gradient holds all of them, so the slices are concatenated. Rows looked up
        independently of the batch (positions: every rank looks up the same indices) give one
        slice per index holding the sum over the batch, so the values are summed."""
        MPI = mpi()
        gathered = self._allgather_rows(indices)
        count = indices.shape[0]
        ranks_alike = gathered.shape[0] == count * self.size and (count == 0 or np.array_equal(
            gathered.reshape(self.size, count), np.broadcast_to(indices, (self.size, count))))
        if ranks_alike:
            values = np.array(values, copy=True, order="C")
            self._mpi.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
            return indices, values
        return gathered, self._allgather_rows(values)

    def _allgather_rows(self, array):
        """Every rank's rows of `array`, concatenated in rank order (runs on the worker)."""
        array = np.ascontiguousarray(array)
        counts = self._mpi.allgather(array.shape[0])
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        gathered = np.empty((sum(counts),) + array.shape[1:], array.dtype)
        self._mpi.Allgatherv(array.reshape(-1).view(np.uint8),
                             [gathered.reshape(-1).view(np.uint8), [n * row_bytes for n in counts]])
        return gathered

    def _allreduce_bucket(self, array):
        """Sums `array` over all ranks in place (runs on the worker)."""
        MPI = mpi()
        if array.nbytes < _RING_MIN_BYTES or not self._ring_allreduce or self.size == 1:
            self._mpi.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            return
        # Ring allreduce: MPI moves the data, numpy adds. Measured on 2 ranks, 40 MB:
        # 7.8 ms against 16.3 ms for MPICH's Allreduce, whose summation loop is the bottleneck.
        chunks = np.array_split(array.reshape(-1), self.size)
        if self._scratch.nbytes < chunks[0].nbytes:
            self._scratch = np.empty(chunks[0].nbytes, np.uint8)
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for step in range(self.size - 1):  # reduce-scatter: chunk i ends complete on rank i-1
            arriving = chunks[(self.rank - step - 1) % self.size]
            incoming = self._scratch[:arriving.nbytes].view(arriving.dtype)
            self._mpi.Sendrecv(chunks[(self.rank - step) % self.size], dest=right,
                               recvbuf=incoming, source=left)
            np.add(arriving, incoming, out=arriving)
        for step in range(self.size - 1):  # allgather the complete chunks: identical bits everywhere
            self._mpi.Sendrecv(chunks[(self.rank + 1 - step) % self.size], dest=right,
                               recvbuf=chunks[(self.rank - step) % self.size], source=left)

    def collect_buckets(self):
        """Waits until every bucket of this step is reduced; returns them in plan order (and
        sets `global_samples` where the round opened its step)."""
        with self._round_lock:
            step_round, self._round = self._round, None
        called = timeline.recorder and timeline.recorder.now()
        try:
            self._wait(step_round.wait, f"the gradient allreduce of step {self._steps_reduced + 1}")
        except BaseException as error:
            raise _remember(error)
        if timeline.recorder is not None:
            timeline.recorder.caller_waited("the gradient allreduce", called)
        self._steps_reduced += 1
        self.global_samples = step_round.global_samples
        return step_round.arrays


_SAVE_HINT = (" If only the master calls save (`if tnt.is_master_rank(): model.save(...)`): call save on "
              "every rank; tarantella writes on the master only.")


# The methods a user calls that run collectives, as named in the rank's messages.
_USER_CALLS = {"fit", "evaluate", "predict", "save", "save_weights", "save_model"}
_PACKAGE_FOLDER = os.path.dirname(os.path.abspath(__file__))


def _with_call(what):
    """`what`, followed by the tarantella method the program called, e.g. "(in evaluate)".

    Read from the main thread's stack, so it costs nothing until a message needs it."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    call = None
    while frame is not None:
        code = frame.f_code
        if code.co_name in _USER_CALLS and os.path.dirname(code.co_filename) == _PACKAGE_FOLDER:
            call = code.co_name  # the outermost wins: evaluate inside fit is fit's validation
        frame = frame.f_back
    return f"{what} (in {call})" if call else what


def _finish(communicator):
    """At the program's end: tell the other ranks, unless a failed collective left this rank
    out of step (its worker may still wait inside MPI, and MPI_Finalize would wait for ever)."""
    if communicator._broken is None:
        communicator.peers.announce_finished()
        return
    sys.stderr.write(f"tarantella: rank {communicator.rank} on host {communicator.host} reached the end of the "
                     f"program after a failed collective ({communicator._broken}); stopping all ranks.\n")
    sys.stderr.flush()
    from tarantella import rank_entry
    culprit = getattr(_first_failure, "culprit", None)
    rank_entry.announce(rank_entry.FAILED, "CollectiveError",
                        rank_entry.UNKNOWN_CULPRIT if culprit is None else str(culprit),
                        f"it reached the end of the program after a failed collective ({communicator._broken})")
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


def _remember(error):
    global _first_failure
    if _first_failure is None and isinstance(error, CollectiveError):
        _first_failure = error
    return error


class _PeerMonitor:
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
        return comm.entered, None if current is None else _with_call(current), comm.last, comm.host

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
        what = _with_call(what)
        rank, (entered, _, last, host) = gone[0]
        summary = (f"rank {rank} on host {host} left early: it finished the program after collective "
                   f"#{entered} ({last}) while rank {self._comm.rank} waited for it in {what} "
                   f"(#{self._comm.entered})")
        raise RankLeftError(
            f"rank {self._comm.rank}: {summary}. Every rank must run the same collectives: a rank may "
            "end only when the others need it no more." + _SAVE_HINT * ("save" in what), summary=summary,
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


_world = None
_MPI = None  # mpi4py's MPI module, or _SerialMPI
# Set in every rank by the MPI launchers (Hydra, Open MPI, PMIx) and by the `tarantella` command.
_LAUNCHER_VARIABLES = ("TNT_ANNOUNCE_RANKS", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def mpi():
    """The MPI module collectives use: mpi4py's, or a serial stand-in where no MPI is installed."""
    init()
    return _MPI


def _started_by_an_mpi_launcher():
    slurm_tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")  # srun; a batch script's own step has 1
    return any(os.environ.get(name) for name in _LAUNCHER_VARIABLES) or (slurm_tasks.isdigit() and
                                                                         int(slurm_tasks) > 1)


def _check_the_launcher_reached_mpi(MPI):
    """The launcher started several ranks but MPI sees one: the launcher and the MPI library do not
    fit (srun's PMI plug-in, or an mpiexec of another MPI than the one mpi4py loaded), and every
    rank became a job of its own. Each would train alone, all as the master, writing the same files.
    (A process that runs without MPI, such as a rank's worker process, inherits the launcher's
    variables but is no rank.)"""
    if MPI is _SerialMPI or MPI.COMM_WORLD.Get_size() != 1:
        return
    if "SLURM_STEP_NUM_TASKS" in os.environ:
        tasks = os.environ.get("PMI_SIZE") or os.environ["SLURM_STEP_NUM_TASKS"]
        if tasks.isdigit() and int(tasks) > 1:
            chosen = os.environ.get("SLURM_MPI_TYPE", "none")
            raise RuntimeError(
                f"srun started {tasks} tasks, but MPI made each of them a job of its own (size 1): srun's PMI "
                f"plug-in ({chosen}) does not suit this MPI library. Start the ranks with `srun --mpi=pmi2` (MPICH, "
                "Intel MPI) or `srun --mpi=pmix` (Open MPI); `srun --mpi=list` shows what the cluster offers. Or "
                "run the `tarantella` command inside the allocation, which chooses for you.")
        return
    for variable, launcher in (("PMI_SIZE", "a Hydra mpiexec (MPICH, Intel MPI, MVAPICH)"),
                               ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun")):
        ranks = os.environ.get(variable, "")
        if ranks.isdigit() and int(ranks) > 1:
            library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
            raise RuntimeError(
                f"{launcher} started {ranks} ranks, but the MPI library that mpi4py loaded ({library}) made each "
                "of them a job of its own (size 1): the launcher belongs to another MPI than the library. Start "
                "the ranks with the mpiexec of the same MPI (the `tarantella` command picks the one beside this "
                "Python first), or point mpi4py at the launcher's library with MPI4PY_LIBMPI=/path/to/libmpi.so.")


class _SerialComm:
    """A communicator of one process, for a serial run without MPI: every collective's result
    is this process's own contribution."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Dup(self):
        return self

    def Split_type(self, *args, **kwargs):
        return self

    def Free(self):
        pass

    def Allreduce(self, send, recv=None, op=None):
        if send is not _SerialMPI.IN_PLACE:
            np.copyto(recv, send)

    def Bcast(self, buffer, root=0):
        pass

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def Allgatherv(self, send, recv):
        buffer, _counts = recv
        np.copyto(buffer, send)

    def Abort(self, status=1):
        os._exit(status)


class _SerialMPI:
    """Stands in for mpi4py's MPI module (the names tarantella uses) in a serial run without MPI."""
    IN_PLACE = object()
    SUM, PROD, MIN, MAX = "sum", "prod", "min", "max"
    COMM_TYPE_SHARED = None
    COMM_WORLD = _SerialComm()


def init():
    """Starts MPI, configures this process as one rank and returns its communicator.

    Safe to call again: later calls return the same communicator.
    """
    global _world
    if _world is not None:
        return _world
    setting_warnings = config.check_environment()  # bad settings fail here, on every rank, before any collective
    ring_allreduce = config.ring_allreduce()
    global _MPI
    missing_mpi = None
    worker = _multiprocessing_worker()
    try:
        if worker:
            # It inherited its rank's MPI variables, but it is no rank: joining MPI would fail
            # (endless PMI errors) or, worse, disturb its rank's connection to the MPI launcher.
            raise ImportError(f"a {worker} worker process of a rank, which runs without MPI")
        from mpi4py import MPI
    except (ImportError, RuntimeError) as error:  # no mpi4py, or mpi4py without an MPI library
        if _started_by_an_mpi_launcher() and not worker:
            raise ImportError(
                f"tarantella found no MPI ({str(error).splitlines()[0]}), but this process was started as a "
                "rank of a parallel job. Install MPI for it: pip install 'tarantella[mpich]', or a system "
                "MPI (e.g. apt-get install libmpich-dev) with mpi4py, pointing MPI4PY_LIBMPI at its "
                "libmpi.so.") from None
        missing_mpi = str(error).splitlines()[0] if str(error) else type(error).__name__
        MPI = _SerialMPI
    _MPI = MPI
    world = MPI.COMM_WORLD
    _check_the_launcher_reached_mpi(MPI)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    bound_to_own_cores = local_size > 1 and config.bind_cores() and _bind_to_own_cores(node, local_rank)
    node.Free()
    side = world.Dup() if world.Get_size() > 1 else None
    _world = Communicator(world.Dup(), config.collective_timeout_s(), ring_allreduce, side_comm=side,
                          stall_warning_s=config.stall_warning_s())
    if _world.peers is not None:
        # Registered after MPI's own exit handler, so it runs first, while MPI still works.
        atexit.register(_finish, _world)
    _configure_logging(_world.rank)
    if not config.announce_ranks():  # started by the tarantella command, which said these already
        for warning in setting_warnings:
            logger.warning(warning)
    if missing_mpi is not None:
        logger.info("no MPI (%s): running as a single process, without MPI.", missing_mpi)
    if _world.size > 1 or not config.use_gpu():
        _configure_devices(local_rank, local_size, bound_to_own_cores)
    if _world.size > 1:
        _stop_all_ranks_on_uncaught_error(_world.rank)
        from tarantella import rank_entry
        rank_entry.watch_parent()  # started already where the `tarantella` command runs the rank
        if rank_entry.reports_to_the_command():
            _report_the_programs_mpi_aborts(MPI)
    if config.timeline_path() is not None:
        timeline.start(_world, config.timeline_path())
    return _world


def _report_the_programs_mpi_aborts(MPI):
    """Makes MPI.COMM_WORLD (and the communicators the program derives from it) report a call
    of Abort to the `tarantella` command before aborting, so that it names this rank."""
    from tarantella import rank_entry

    class ReportingIntracomm(MPI.Intracomm):
        def Abort(self, errorcode=0):
            rank_entry.report_mpi_abort(errorcode)
            super().Abort(errorcode)

    MPI.COMM_WORLD = ReportingIntracomm(MPI.COMM_WORLD)


def _multiprocessing_worker():
    """'spawn' or 'forkserver' in a process that Python's multiprocessing started that way (e.g. a
    data loader's worker pool), which imports the program's main module, and with it tarantella;
    else None. (A forked worker is a copy of its rank and never imports tarantella anew.)"""
    arguments = " ".join(getattr(sys, "orig_argv", sys.argv))
    if "--multiprocessing-fork" in arguments or "multiprocessing.spawn" in arguments:
        return "spawn"
    if "multiprocessing.forkserver" in arguments:
        return "forkserver"
    return None


def tell_other_ranks_this_one_failed(summary):
    """Tells the other ranks (when MPI runs here) that this one fails as `summary` says, so that
    they fail naming it at their next collective instead of waiting for it there."""
    if _world is not None and _world.peers is not None:
        _world.peers.announce_failure(summary)


def get_rank():
    """This process's rank: 0 for the master, up to `get_size() - 1`.

    Returns:
        int: the rank; 0 in a serial run.
    """
    return init().rank


def get_size():
    """The number of ranks in the job.

    Returns:
        int: the number of ranks; 1 in a serial run.
    """
    return init().size


def get_master_rank():
    """The master's rank, which writes files and prints Keras' output.

    Returns:
        int: always 0.
    """
    return MASTER_RANK


def is_master_rank():
    """Whether this process is the master (rank 0), e.g. to print something once.

    Returns:
        bool: True on rank 0.
    """
    return get_rank() == MASTER_RANK


def _configure_logging(rank):
    on_all = config.log_on_all_devices()
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[tarantella rank {rank}]" if on_all else "[tarantella]"
    handler.setFormatter(logging.Formatter(prefix + " %(levelname)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(config.log_level() if on_all or rank == MASTER_RANK else "ERROR")


def _cores_by_physical_core(cores):
    """`cores` ordered so that the hardware threads of one physical core are adjacent."""
    def place(cpu):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as package, open(topology + "core_id") as core:
                return int(package.read()), int(core.read()), cpu
        except (OSError, ValueError):
            return 0, cpu, cpu
    return sorted(cores, key=place)


def _bind_to_own_cores(node, local_rank):
    """Ranks of a node that may all run on the same cores split them: each binds every thread it
    runs (and those it starts later) to its own share. Unbound, each rank's thread pools (XLA's,
    the input pipeline's, MPI's) are sized to all of those cores and fight over them. A rank that
    a launcher or scheduler bound to cores of its own keeps them. True where this rank bound itself."""
    cores = sorted(os.sched_getaffinity(0))
    sharing = [rank for rank, theirs in enumerate(node.allgather(cores)) if theirs == cores]
    if len(sharing) < 2 or len(cores) < len(sharing):
        return False
    index, parts = sharing.index(local_rank), len(sharing)
    own = _cores_by_physical_core(cores)[index * len(cores) // parts:(index + 1) * len(cores) // parts]
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), own)
        except OSError:  # a thread that ended meanwhile
            pass
    return True


def _configure_devices(local_rank, local_size, bound_to_own_cores):
    """Gives each rank its share of the node: its own GPU if there is one per rank, else CPU threads
    (as many as its own cores, where it bound itself to them). On Keras' JAX and torch backends
    the GPU goes to JAX or torch, and TensorFlow, there only for the input pipeline, gets none."""
    import tensorflow as tf
    keras = sys.modules.get("keras")
    backend = keras.backend.backend() if keras is not None else "tensorflow"
    threads = config.threads_per_rank()
    if threads is None and local_size > 1:
        # Measured on 2 cores: one thread per rank beats TensorFlow's defaults by 25%.
        cores = len(os.sched_getaffinity(0))
        threads = cores if bound_to_own_cores else max(1, cores // local_size)
    try:
        gpus = tf.config.list_physical_devices("GPU")
        gpu = _gpu_of_this_rank(local_rank, local_size, len(gpus)) if backend == "tensorflow" else None
        if gpu is not None:
            tf.config.set_visible_devices([gpus[gpu]], "GPU")
            tf.config.experimental.set_memory_growth(gpus[gpu], True)
        elif gpus:
            tf.config.set_visible_devices([], "GPU")
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow started before tarantella was imported
        logger.warning("TensorFlow was already running when tarantella was imported, so this rank keeps "
                       "TensorFlow's default devices and threads and may compete with %d other rank(s) on "
                       "this node. Import tarantella before using TensorFlow.", local_size - 1)
    if backend == "jax":
        _configure_jax(local_rank, local_size)
    elif backend == "torch":
        _configure_torch(local_rank, local_size, threads)


def _gpu_of_this_rank(local_rank, local_size, gpus):
    """The index of this rank's GPU among the node's `gpus`, or None where it trains on CPU. Ranks
    sharing a GPU that each took all its memory would run out of it, so with fewer GPUs than ranks
    every rank trains on CPU (with a warning, unless the job asked for CPUs), unless TNT_SHARE_GPUS
    lets them share."""
    if not gpus or not config.use_gpu():
        return None
    if local_size <= gpus or config.share_gpus():
        return local_rank % gpus
    logger.warning("%d ranks on this node but %d GPU(s): every rank runs on CPU (TNT_SHARE_GPUS=true lets them "
                   "share the GPUs).", local_size, gpus)
    return None


def _configure_jax(local_rank, local_size):
    """JAX's devices must be chosen before it first uses them (its backends start lazily)."""
    import jax
    from tarantella.launcher.placement import count_gpus
    gpus = count_gpus()
    gpu = _gpu_of_this_rank(local_rank, local_size, gpus)
    if gpu is None:
        jax.config.update("jax_platforms", "cpu")
        return
    jax.config.update("jax_cuda_visible_devices", str(gpu))
    if local_size > gpus:  # by default JAX takes 75% of its GPU's memory when it starts
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _configure_torch(local_rank, local_size, threads):
    """On Keras' PyTorch backend the step's compute is torch's: the rank's own GPU, else its share
    of the node's cores instead of every core for every rank."""
    import torch
    # Keras' torch backend chose its device when it was imported (before MPI told this rank which
    # GPU is its own); tests/test_torch_backend.py checks that it still reads it from here.
    from keras.src.backend.torch import core as keras_torch_core
    gpu = _gpu_of_this_rank(local_rank, local_size, torch.cuda.device_count())
    if gpu is not None:
        torch.cuda.set_device(gpu)
        keras_torch_core.DEFAULT_DEVICE = f"cuda:{gpu}"
    else:
        keras_torch_core.DEFAULT_DEVICE = "cpu"
    if threads:
        torch.set_num_threads(threads)


def _stop_all_ranks_on_uncaught_error(rank):
    """An error on one rank must end the whole job, not leave the others waiting."""
    previous_hook = sys.excepthook

    def abort_job(exc_type, exc, tb):
        cause = collective_failure_behind(exc)
        if cause is None:
            previous_hook(exc_type, exc, tb)
        else:  # the traceback would show tarantella's internals, and TensorFlow's wrapping repeats it
            exc_type, exc = type(cause), cause
            sys.stderr.write(f"{exc_type.__name__}: {exc}\n")
        summary = f": {exc.summary}" if isinstance(exc, CollectiveError) and exc.summary else ""
        sys.stderr.write(f"tarantella: rank {rank} on host {socket.gethostname()} failed with "
                         f"{exc_type.__name__}{summary}; stopping all ranks.\n")
        sys.stderr.flush()
        time.sleep(_ABORT_GRACE_S)  # ranks failing on the same bad input get to print their error too
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_job


def collective_failure_behind(error):
    """The CollectiveError that `error` is or wraps (TensorFlow turns an error raised inside a
    training step into an UnknownError carrying its text), else None."""
    if isinstance(error, CollectiveError):
        return error
    if _first_failure is not None and str(_first_failure) in str(error):
        return _first_failure
    return None
