"""The gradient reducer: a training step's fused buckets, handed over while backprop runs and
reduced on the communicator's worker in one plan order, the same on every rank.

A step calls `submit(index, count, array, ...)` for each bucket as it becomes ready and
`collect()` for the results. How a bucket is reduced is the reducer's `reduction`, an object with
  reduce_dense(mpi_comm, array): sum `array` over the ranks in place (it runs on the worker);
  reduce_sparse(mpi_comm, indices, values) -> (indices, values) of the global batch;
so that another reduction (a reduce-scatter, no sum at all) plugs in here without touching the
worker or the steps. `SumOverRanks` is the default: MPI's allreduce for small buckets, a ring (MPI
moves the bytes, numpy adds) for large ones. `SixteenBitWire` sends float32 buckets as 16-bit
floats and adds them in float32.
"""

import threading

import ml_dtypes
import numpy as np

from tarantella.runtime import events
from tarantella.runtime.communicator import allgather_rows
from tarantella.runtime.errors import CollectiveError, remember
from tarantella.runtime.kinds import Collective

_RING_MIN_BYTES = 1 << 20  # below this MPI's own algorithms have the lower latency


class BucketRound:
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
        # Set where the round opens its step (see Reducer.submit).
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


class Reducer:
    """Reduces each training step's gradient buckets over the ranks, through `communicator`'s
    worker and in its fixed order, with `reduction` (default: `SumOverRanks`)."""

    def __init__(self, communicator, reduction):
        self._comm = communicator
        self.reduction = reduction
        self._round = None
        self._round_lock = threading.Lock()
        self._steps_reduced = 0
        self.global_samples = None  # the global batch size the last collected round carried

    def submit(self, index, count, array, agreed=False, opening=None):
        """Hands over bucket `index` of `count`; returns at once.

        An array is summed over ranks in place; a tuple (indices, values) of a sparse gradient
        becomes the global batch's (see `SumOverRanks.reduce_sparse`). With `agreed`, the
        opening of the step agreed on this round.

        With `opening` (sequence, samples, divisor), the round opens its step: its first
        message agrees on the step's `sequence` of collectives (a string) and sums the
        ranks' `samples`, the global batch size B (`collect` then sets `global_samples`). The
        rank differentiated its loss divided by `divisor`, its guess of B; where that was
        wrong, its in-place buckets are rescaled before they are summed."""
        comm = self._comm
        comm.refuse_if_broken(Collective.GRADIENTS.what)
        with self._round_lock:
            if self._round is None:
                self._round = BucketRound(count)
                step_round = self._round
                what = f"{Collective.GRADIENTS.what} of step {self._steps_reduced + 1}"
                if opening is not None:
                    sequence, samples, divisor = opening
                    begin = lambda: step_round.open(self._open_round(what, sequence, samples), divisor)
                else:
                    agree_on = None if agreed else round_on_wire(f"{Collective.GRADIENTS.what} of {count} buckets",
                                                                 self.reduction.wire)
                    begin = lambda: comm.enter(what, agree_on, kind=Collective.GRADIENTS)
                comm.submit_job(lambda: self._reduce_round(step_round, begin))
            step_round = self._round
        if events.observer is not None:
            events.observer.handed_over(index)
        step_round.deposit(index, array)

    def _open_round(self, what, sequence, samples):
        """The agreement and sum of micro-batch sizes a gradient round opens its step with."""
        kind = Collective.STEP_OPENING
        opening = lambda: self._comm.enter(what, sequence, carried=samples, kind=kind)
        if events.observer is None:
            return opening()
        return events.observer.run_collective(kind, f"{kind.what} that opens {what}", opening)

    def _reduce_round(self, step_round, begin):
        observer = events.observer
        reduce = (self._reduce_bucket if observer is None else
                  observer.timed_buckets(self._reduce_bucket, self.reduction.wire_bytes))
        try:
            step_round.reduce_in_plan_order(begin, reduce)
        finally:
            self._comm.leave()

    def _reduce_bucket(self, bucket):
        if isinstance(bucket, tuple):
            return self.reduction.reduce_sparse(self._comm.mpi_comm, *bucket)
        self.reduction.reduce_dense(self._comm.mpi_comm, bucket)
        return bucket

    def collect(self):
        """Waits until every bucket of this step is reduced; returns them in plan order (and
        sets `global_samples` where the round opened its step)."""
        with self._round_lock:
            step_round, self._round = self._round, None
        observer = events.observer
        called = observer and observer.now()
        try:
            self._comm.wait_watching(step_round.wait, f"{Collective.GRADIENTS.what} of step {self._steps_reduced + 1}")
        except BaseException as error:
            raise remember(error)
        if observer is not None:
            observer.caller_waited(Collective.GRADIENTS, Collective.GRADIENTS.what, called)
        self._steps_reduced += 1
        self.global_samples = step_round.global_samples
        return step_round.arrays


def round_on_wire(description, wire):
    """What the ranks agree on for a gradient round: its `description`, and the wire where it is not
    float32, so that ranks that would send different bytes fail at once, naming both wires."""
    return description if wire == "float32" else f"{description}, sent as {wire}"


class SumOverRanks:
    """The gradients of the global batch: buckets summed over the ranks, sparse gradients joined.

    Args:
        mpi: the MPI module (for IN_PLACE and SUM).
        ring: whether buckets of 1 MiB or more take the ring instead of MPI's allreduce
            (TNT_ALLREDUCE=mpi turns it off).
    """

    wire = "float32"

    def __init__(self, mpi, ring=True):
        self.mpi = mpi
        self._ring = ring
        self._scratch = np.empty(0, np.uint8)

    @staticmethod
    def wire_bytes(bucket):
        """The bytes of a bucket as it travels (what the timeline records)."""
        return sum(a.nbytes for a in bucket) if isinstance(bucket, tuple) else bucket.nbytes

    def reduce_dense(self, mpi_comm, array):
        """Sums `array` over all ranks in place (runs on the worker)."""
        MPI = self.mpi
        size = mpi_comm.Get_size()
        if array.nbytes < _RING_MIN_BYTES or not self._ring or size == 1:
            mpi_comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            return
        # Ring allreduce: MPI moves the data, numpy adds. Measured on 2 ranks, 40 MB:
        # 7.8 ms against 16.3 ms for MPICH's Allreduce, whose summation loop is the bottleneck.
        rank = mpi_comm.Get_rank()
        chunks = np.array_split(array.reshape(-1), size)
        if self._scratch.nbytes < chunks[0].nbytes:
            self._scratch = np.empty(chunks[0].nbytes, np.uint8)
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):  # reduce-scatter: chunk i ends complete on rank i-1
            arriving = chunks[(rank - step - 1) % size]
            incoming = self._scratch[:arriving.nbytes].view(arriving.dtype)
            mpi_comm.Sendrecv(chunks[(rank - step) % size], dest=right, recvbuf=incoming, source=left)
            np.add(arriving, incoming, out=arriving)
        for step in range(size - 1):  # allgather the complete chunks: identical bits everywhere
            mpi_comm.Sendrecv(chunks[(rank + 1 - step) % size], dest=right,
                              recvbuf=chunks[(rank - step) % size], source=left)

    def reduce_sparse(self, mpi_comm, indices, values):
        """A sparse gradient as a serial step on the global batch would have it.

        Rows looked up per sample (tokens) give every rank different indices: the serial
        gradient holds all of them, so the slices are concatenated. Rows looked up
        independently of the batch (positions: every rank looks up the same indices) give one
        slice per index holding the sum over the batch, so the values are summed."""
        size = mpi_comm.Get_size()
        gathered = allgather_rows(mpi_comm, indices)
        count = indices.shape[0]
        ranks_alike = gathered.shape[0] == count * size and (count == 0 or np.array_equal(
            gathered.reshape(size, count), np.broadcast_to(indices, (size, count))))
        if ranks_alike:
            values = np.array(values, copy=True, order="C")
            mpi_comm.Allreduce(self.mpi.IN_PLACE, values, op=self.mpi.SUM)
            return indices, values
        return gathered, allgather_rows(mpi_comm, values)


class ByNode:
    """Large buckets summed node by node: within each node to its first rank (MPI's reduce over
    shared memory), across the nodes by those first ranks alone (`flat`: the ring), then from each
    node's first rank to the others (MPI's broadcast). The network carries one rank per node, so the
    ring across nodes has p/R ranks instead of p, and pays 2 (nodes - 1) latencies instead of
    2 (p - 1). Every rank ends with the bits its node's first rank got from the ring, the same on
    every rank.

    Buckets below the ring's size, sparse gradients and jobs of one rank take `flat` as they are.

    Args:
        flat: the reduction over all ranks (SumOverRanks).
        node_comm: the ranks of this rank's node (MPI_Comm_split_type SHARED).
        leaders_comm: the first rank of every node, or None on the other ranks.
    """

    def __init__(self, flat, node_comm, leaders_comm):
        self._flat = flat
        self._node = node_comm
        self._leaders = leaders_comm
        self.wire = flat.wire
        self.wire_bytes = flat.wire_bytes
        self.by_node = True  # False sends every bucket through `flat` (the emulated cluster's switch)

    def reduce_dense(self, mpi_comm, array):
        if not self.by_node or array.nbytes < _RING_MIN_BYTES or mpi_comm.Get_size() == 1:
            self._flat.reduce_dense(mpi_comm, array)
            return
        MPI = self._flat.mpi
        if self._leaders is not None:
            self._node.Reduce(MPI.IN_PLACE, array, op=MPI.SUM, root=0)
            self._flat.reduce_dense(self._leaders, array)
        else:
            self._node.Reduce(array, None, op=MPI.SUM, root=0)
        self._node.Bcast(array, root=0)

    def reduce_sparse(self, mpi_comm, indices, values):
        return self._flat.reduce_sparse(mpi_comm, indices, values)


_SIXTEEN_BIT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class SixteenBitWire:
    """Float32 buckets travel as 16-bit floats and are added in float32: half the bytes.

    Each rank rounds its bucket once to `wire` (round to nearest even) and sends chunk i to rank
    i (MPI's all-to-all); rank i adds the p chunks it receives in float32, in rank order, rounds
    the sum once and sends it to every rank (MPI's allgather). Every rank, the owner too, ends
    with the same rounded sums: the weights stay bitwise equal across ranks. MPI only moves the
    bytes, so no 16-bit MPI type is needed.

    Other buckets (the float64 sample counts, integers) and sparse gradients are summed exactly
    by `exact`; so is everything on one rank, where nothing leaves the process.
    """

    def __init__(self, exact, wire):
        self._exact = exact
        self.wire = wire
        self._dtype = np.dtype(_SIXTEEN_BIT[wire])

    def wire_bytes(self, bucket):
        if isinstance(bucket, np.ndarray) and bucket.dtype == np.float32:
            return bucket.size * self._dtype.itemsize
        return self._exact.wire_bytes(bucket)

    def reduce_dense(self, mpi_comm, array):
        size = mpi_comm.Get_size()
        if array.dtype != np.float32 or size == 1:
            self._exact.reduce_dense(mpi_comm, array)
            return
        flat = array.reshape(-1)
        chunk = -(-flat.size // size)
        outgoing = np.zeros((size, chunk), self._dtype)  # the padding of the last chunk stays 0
        outgoing.reshape(-1)[:flat.size] = flat
        incoming = np.empty_like(outgoing)
        mpi_comm.Alltoall(outgoing.view(np.uint16), incoming.view(np.uint16))
        own_sum = incoming.astype(np.float32).sum(axis=0).astype(self._dtype)
        mpi_comm.Allgather(own_sum.view(np.uint16), outgoing.view(np.uint16))
        flat[:] = outgoing.reshape(-1)[:flat.size]

    def reduce_sparse(self, mpi_comm, indices, values):
        return self._exact.reduce_sparse(mpi_comm, indices, values)
