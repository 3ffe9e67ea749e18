"""The only place where the emulated cluster reaches past tarantella's public API.

Everything else in benchmarks/cluster/ uses `tnt.Model`, the `tarantella` command and TNT_*
settings. Three things have no public form, because they exist for this benchmark only:

  scale_ring_cut_over(scale)   the ring's 1 MiB cut-over divided by the byte scale, so that each
                               scaled bucket takes the algorithm its nominal size would
  use_ring(on)                 TNT_ALLREDUCE switched between windows of one job (the setting is
                               read once, at start), so that `tnt` and `tnt-mpi` share the rounds
  ring_allreduce(array)        one bucket through tarantella's own allreduce, for the link probe

When tarantella's modules move, this file is the one to follow them. Each function says, by
returning False or None, that the internal it needs is gone; the worker then reports the
variant or probe as unavailable instead of failing.
"""

RING_MIN_BYTES = 1 << 20  # the nominal cut-over, as tarantella documents it for TNT_ALLREDUCE=ring


def _communication():
    try:
        from tarantella import communication
    except ImportError:
        return None
    return communication if hasattr(communication, "init") else None


def _communicator():
    communication = _communication()
    return None if communication is None else communication.init()


def scale_ring_cut_over(scale):
    communication = _communication()
    if communication is None or not hasattr(communication, "_RING_MIN_BYTES"):
        return False
    communication._RING_MIN_BYTES = max(1, int(RING_MIN_BYTES / scale))
    return True


def use_ring(on, default=[]):
    """Large buckets through tarantella's ring (True, the job's setting) or MPI_Allreduce (False)."""
    comm = _communicator()
    if comm is None or not hasattr(comm, "_ring_allreduce"):
        return False
    if not default:
        default.append(comm._ring_allreduce)
    comm._ring_allreduce = default[0] and on
    return True


def ring_allreduce(array):
    """Sums `array` over the ranks in place as a gradient bucket would be (call on the main thread
    between windows, while tarantella's worker waits). False where the internal is gone."""
    comm = _communicator()
    if comm is None or not hasattr(comm, "_allreduce_bucket"):
        return False
    comm._allreduce_bucket(array)
    return True
