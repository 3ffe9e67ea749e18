"""Making this process a rank: MPI started, its devices chosen, the timeline and the warning signal set up."""

from __future__ import annotations

from tarantella import backends, timeline
from tarantella.backends import devices
from tarantella.common import config
from tarantella.runtime import stop_request, world
from tarantella.runtime.communicator import Communicator

__all__ = ["init"]

_set_up = False


def init() -> Communicator:
    """Starts MPI and makes this process one rank of the job (or the only one).

    `import tarantella` calls it; calling it again returns the same communicator.

    Returns:
        the rank's communicator (`rank` and `size` attributes).

    Raises:
        ImportError: the process was started as a rank of a parallel job, but no MPI is installed.
        RuntimeError: the MPI launcher and the MPI library do not fit, so that every rank would
            become a job of its own.
        ValueError: a `TNT_*` setting of the environment is invalid.
    """
    global _set_up
    communicator = world.init()
    if not _set_up:
        _set_up = True
        if communicator.size > 1 or not config.use_gpu():
            share = world.node_share()
            backends.step_class().configure_devices(share, devices.threads_of_rank(share))
        if config.timeline_path() is not None:
            timeline.start(communicator, config.timeline_path())
        save_signal = config.save_on_signal()
        if save_signal is not None:
            stop_request.listen(communicator, save_signal)
    return communicator
