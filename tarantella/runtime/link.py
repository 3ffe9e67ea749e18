"""The job's slowest link, as the gradient ring meets it: measured once at start-up where the ranks
span several nodes, so that the fusion threshold can follow the network the job got
(`backends.fusion.automatic_threshold_bytes`)."""

import statistics
import time
from dataclasses import dataclass

import numpy as np

_LATENCY_ROUNDS = 24
_RATE_ROUNDS = 3
_FIRST_RATE_BYTES = 64 << 10
_LARGEST_RATE_BYTES = 4 << 20
# A message this long measures the rate rather than the latency, on any link from Ethernet to InfiniBand.
_RATE_MESSAGE_SECONDS = 2e-3


@dataclass(frozen=True)
class Link:
    """What one message costs between ring neighbours: `latency_s` for a small one (MPI's latency
    and mpi4py's call, as the ring pays them at each of its steps), and `bytes_per_s` for the
    bytes of a large one, in each direction while both directions are busy, as in the ring."""
    latency_s: float
    bytes_per_s: float

    def describe(self):
        return f"{self.latency_s * 1e6:.0f} us and {self.bytes_per_s * 8 / 1e9:.3g} Gb/s"


def measure(MPI, comm):
    """Collective over `comm` (of mpi4py's module `MPI`), on every rank at once: each rank sends
    to the next and receives from the one before, all starting together, first small messages,
    then larger ones until a message takes long enough to show the rate. The slowest rank's times count (the ring waits
    for it), so every rank returns the same Link."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size

    def slowest_median(outgoing, rounds):
        incoming = np.empty_like(outgoing)
        times = []
        for _ in range(rounds + 1):  # the first round also sets up the connection
            # Rounds back to back fall into step with each other, and then hide the wait for a
            # busy peer that a bucket's first ring step pays: each round starts from a barrier.
            comm.Barrier()
            started = time.perf_counter()
            comm.Sendrecv(outgoing, dest=right, recvbuf=incoming, source=left)
            times.append(time.perf_counter() - started)
        return comm.allreduce(statistics.median(times[1:]), op=MPI.MAX)

    latency = slowest_median(np.zeros(1, np.float64), _LATENCY_ROUNDS)
    nbytes = _FIRST_RATE_BYTES
    while True:
        seconds = slowest_median(np.zeros(nbytes, np.uint8), _RATE_ROUNDS)
        if seconds >= _RATE_MESSAGE_SECONDS or nbytes >= _LARGEST_RATE_BYTES:
            break
        nbytes *= 4
    return Link(latency, nbytes / max(seconds - latency, seconds / 2))
