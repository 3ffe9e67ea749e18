"""Making this process a rank: MPI started, its devices chosen, the timeline on where asked for."""

from tarantella import backends, timeline
from tarantella.backends import devices
from tarantella.common import config
from tarantella.runtime import world

_set_up = False


def init():
    """Starts MPI and makes this process one rank of the job (or the only one).

    `import tarantella` calls it; calling it again returns the same communicator.

    Returns:
        the rank's communicator (`rank` and `size` attributes).
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
    return communicator
