"""Checks that every rank set up the same training step, so that no rank trains differently.

Variable shapes alone cannot tell SGD from RMSprop with the same slots, or two learning
rates: the ranks would exit 0 with different weights. So the compile settings (optimizer
class and configuration, losses, metrics, loss weights, ...) are compared at the first
broadcast, and the first difference is named.
"""

from tarantella.runtime import world


def check_same_compile_settings(comm, model):
    """Raises ValueError on every rank if the ranks compiled `model` differently."""
    settings = model.get_compile_config() if model.compiled else None
    everyone = comm.allgather(settings, "the check that all ranks compiled the same training step")
    master = everyone[world.MASTER_RANK]
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != master]
    if not differing:
        return
    rank = differing[0]
    where, theirs, masters = _first_difference(everyone[rank], master, "compile")
    raise ValueError(
        f"The compiled training step differs between ranks (ranks {differing} differ from the master): "
        f"{where} is {theirs!r} on rank {rank} but {masters!r} on the master. Every rank must compile the "
        "same optimizer (class and settings), loss, metrics and options.")


def _first_difference(theirs, masters, where):
    """(path, their value, the master's value) of the first place where two settings differ."""
    if isinstance(theirs, dict) and isinstance(masters, dict):
        # The class name says more than its settings: compare it first.
        keys = sorted(set(theirs) | set(masters), key=lambda key: (key != "class_name", str(key)))
        for key in keys:
            if theirs.get(key) != masters.get(key):
                return _first_difference(theirs.get(key), masters.get(key), f"{where}[{key!r}]")
    if isinstance(theirs, (list, tuple)) and isinstance(masters, (list, tuple)) and len(theirs) == len(masters):
        for index, (mine, other) in enumerate(zip(theirs, masters)):
            if mine != other:
                return _first_difference(mine, other, f"{where}[{index}]")
    return where, theirs, masters
