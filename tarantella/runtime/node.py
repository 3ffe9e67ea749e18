"""This rank's share of its node: its local rank among the ranks on the node, and its own cores."""

import os
from dataclasses import dataclass

from tarantella.common.hardware import cores_by_physical_core


@dataclass(frozen=True)
class NodeShare:
    """Where this rank sits on its node.

    Attributes:
        local_rank: this rank's number among the ranks of its node.
        local_size: how many ranks run on the node.
        bound_to_own_cores: whether this rank bound its threads to a share of the node's cores.
        nodes: how many nodes the job's ranks run on.
    """
    local_rank: int
    local_size: int
    bound_to_own_cores: bool
    nodes: int = 1


def bind_to_own_cores(node_comm, local_rank):
    """Ranks of a node that may all run on the same cores split them: each binds every thread it
    runs (and those it starts later) to its own share. Unbound, each rank's thread pools (XLA's,
    the input pipeline's, MPI's) are sized to all of those cores and fight over them. A rank that
    a launcher or scheduler bound to cores of its own keeps them. True where this rank bound itself."""
    cores = sorted(os.sched_getaffinity(0))
    sharing = [rank for rank, theirs in enumerate(node_comm.allgather(cores)) if theirs == cores]
    if len(sharing) < 2 or len(cores) < len(sharing):
        return False
    index, parts = sharing.index(local_rank), len(sharing)
    own = cores_by_physical_core(cores)[index * len(cores) // parts:(index + 1) * len(cores) // parts]
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), own)
        except OSError:  # a thread that ended meanwhile
            pass
    return True
