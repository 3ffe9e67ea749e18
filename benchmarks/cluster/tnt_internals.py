"""The only place where the emulated cluster reaches past tarantella's public API.

Everything else in benchmarks/cluster/ uses `tnt.Model`, the `tarantella` command and TNT_*
settings. These have no public form, because they exist for this benchmark only:

  scale_ring_cut_over(scale)   the ring's 1 MiB cut-over divided by the byte scale, so that each
                               scaled bucket takes the algorithm its nominal size would
  use_ring(on)                 TNT_ALLREDUCE switched between windows of one job (the setting is
                               read once, at start), so that `tnt` and `tnt-mpi` share the rounds
  use_by_node(on)              TNT_HIERARCHICAL_ALLREDUCE switched between windows, so that `tnt`
                               (node by node where several ranks share a host) and `flat` share the rounds
  ring_allreduce(array)        one bucket through tarantella's own allreduce, for the link probe
  automatic_threshold_kb(scale)  the fusion threshold tarantella picks for this job where
                               TNT_FUSION_THRESHOLD is unset, on the link as shaped now (the worker
                               sets it per variant and link)

When tarantella's modules move, this file is the one to follow them. Each function says, by
returning False or None, that the internal it needs is gone; the worker then reports the
variant or probe as unavailable instead of failing.
"""

RING_MIN_BYTES = 1 << 20  # the nominal cut-over, as tarantella documents it for TNT_ALLREDUCE=ring


def _layout():
    """(module holding _RING_MIN_BYTES, the object whose `_ring` or `_ring_allreduce` says whether
    large buckets take the ring, a function summing an array in place as a bucket), or None.
    Knows tarantella's two layouts: runtime/ (reducer.py, world.py) and the older single
    communication.py."""
    try:
        from tarantella.runtime import reducer, world
    except ImportError:
        pass
    else:
        world.init()
        reduction = world.gradient_reducer().reduction
        reduction = getattr(reduction, "_flat", reduction)  # under the reduction by node: the flat one
        from mpi4py import MPI
        return reducer, reduction, "_ring", lambda array: reduction.reduce_dense(MPI.COMM_WORLD, array)
    try:
        from tarantella import communication
    except ImportError:
        return None
    comm = communication.init()
    return communication, comm, "_ring_allreduce", comm._allreduce_bucket


def scale_ring_cut_over(scale):
    layout = _layout()
    if layout is None or not hasattr(layout[0], "_RING_MIN_BYTES"):
        return False
    layout[0]._RING_MIN_BYTES = max(1, int(RING_MIN_BYTES / scale))
    return True


def use_ring(on, default=[]):
    """Large buckets through tarantella's ring (True, the job's setting) or MPI_Allreduce (False)."""
    layout = _layout()
    if layout is None or not hasattr(layout[1], layout[2]):
        return False
    if not default:
        default.append(getattr(layout[1], layout[2]))
    setattr(layout[1], layout[2], default[0] and on)
    return True


def use_by_node(on):
    """Large buckets summed node by node (True, where the job chose it: TNT_HIERARCHICAL_ALLREDUCE)
    or by one ring over all ranks (False). None where the job sums them flat anyway; False where the
    internal is gone."""
    try:
        from tarantella.runtime import world
    except ImportError:
        return False
    reduction = world.gradient_reducer().reduction
    if not hasattr(reduction, "_flat"):
        return None
    if not hasattr(reduction, "by_node"):
        return False
    reduction.by_node = on
    return True


def ring_allreduce(array):
    """Sums `array` over the ranks in place as a gradient bucket would be (call on the main thread
    between windows, while tarantella's worker waits). False where the internal is gone."""
    layout = _layout()
    if layout is None:
        return False
    layout[3](array)
    return True


def automatic_threshold_kb(scale):
    """(KiB, nodes, {latency_us, gbit}): the fusion threshold tarantella picks for this job where
    TNT_FUSION_THRESHOLD is unset, from its own measurement of the links as they are shaped now
    (collective: every rank calls it at once), nominal: the measured rate times the byte scale.
    None where tarantella has no such rule."""
    try:
        from tarantella.backends import fusion
        from tarantella.runtime import link, world
    except ImportError:
        return None
    from mpi4py import MPI
    nodes = world.node_share().nodes
    if nodes <= 1:
        return fusion.automatic_threshold_bytes(world.init().size, nodes) / 1024, nodes, None
    measured = link.measure(MPI, MPI.COMM_WORLD)
    nominal_rate = measured.bytes_per_s * scale
    kb = fusion.automatic_threshold_bytes(world.init().size, nodes, measured.latency_s, nominal_rate) / 1024
    return kb, nodes, {"latency_us": measured.latency_s * 1e6, "gbit": nominal_rate * 8 / 1e9}
