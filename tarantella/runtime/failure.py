"""How one rank's failure ends the whole job, naming the rank, instead of leaving the others
waiting in a collective."""

import socket
import sys
import time

from tarantella.common import rank_entry
from tarantella.runtime.errors import CollectiveError, collective_failure_behind, first_failure

_ABORT_GRACE_S = 1.0


def stop_all_ranks_on_uncaught_error(rank):
    """An uncaught error on this rank aborts the job (MPI_Abort) after saying so."""
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


def finish(communicator):
    """At the program's end: tell the other ranks, unless a failed collective left this rank
    out of step (its worker may still wait inside MPI, and MPI_Finalize would wait for ever)."""
    if communicator.broken is None:
        communicator.peers.announce_finished()
        return
    sys.stderr.write(f"tarantella: rank {communicator.rank} on host {communicator.host} reached the end of the "
                     f"program after a failed collective ({communicator.broken}); stopping all ranks.\n")
    sys.stderr.flush()
    culprit = getattr(first_failure(), "culprit", None)
    rank_entry.announce(rank_entry.FAILED, "CollectiveError",
                        rank_entry.UNKNOWN_CULPRIT if culprit is None else str(culprit),
                        f"it reached the end of the program after a failed collective ({communicator.broken})")
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


def report_the_programs_mpi_aborts(MPI):
    """Makes MPI.COMM_WORLD (and the communicators the program derives from it) report a call
    of Abort to the `tarantella` command before aborting, so that it names this rank."""

    class ReportingIntracomm(MPI.Intracomm):
        def Abort(self, errorcode=0):
            rank_entry.report_mpi_abort(errorcode)
            super().Abort(errorcode)

    MPI.COMM_WORLD = ReportingIntracomm(MPI.COMM_WORLD)
