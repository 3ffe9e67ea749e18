"""Tarantella: data-parallel training of Keras 3 models over MPI.

`import tarantella as tnt` makes this process one rank of the job (or the only one).
"""

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

__version__ = "0.10.0"

# What `from tarantella import *` binds: the version here, the public functions and classes below once
# they are imported (never in the `tarantella` command, which imports none of them). The namespaces
# tnt.data, tnt.models, tnt.optimizers and tnt.keras are left out, so that a star import cannot hide
# the user's own `keras` or `data`.
__all__ = ["__version__"]


def _started_as_launcher():
    """True in the `tarantella` and `tarantella-timeline` commands, which are no ranks."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("tarantella", "tarantella-timeline"):
        return True
    argv = getattr(sys, "orig_argv", [])
    return "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] in (
        ["tarantella"], ["tarantella.launcher"], ["tarantella.timeline_picture"])


if not _started_as_launcher():
    from tarantella import backends as _backends
    _backends.check_supported()

    from tarantella.runtime.errors import (CollectiveError, CollectiveMismatchError, CollectiveTimeoutError,
                                           RankFailedError, RankLeftError)
    from tarantella.runtime.world import get_master_rank, get_rank, get_size, is_master_rank
    from tarantella.rank import init
    from tarantella.model import Model, ParallelStrategy, Sequential
    from tarantella.collectives import (ReductionOp, TensorAllgatherer, TensorAllreducer, TensorBroadcaster,
                                        allgather, allreduce, barrier, broadcast, broadcast_variables)
    from tarantella import data, optimizers  # tnt.data.distribute, tnt.optimizers.Optimizer
    from tarantella import models  # tnt.models.load_model, ..., like keras.models
    from tarantella import callbacks as _callbacks
    from tarantella import backups as _backups  # noqa: F401 (adds the automatic backups to every fit)

    keras = SimpleNamespace(callbacks=_callbacks)  # tnt.keras.callbacks.Callback

    __all__ += [
        "init", "get_rank", "get_size", "get_master_rank", "is_master_rank",
        "Model", "Sequential", "ParallelStrategy",
        "allreduce", "broadcast", "allgather", "barrier", "broadcast_variables",
        "ReductionOp", "TensorAllreducer", "TensorBroadcaster", "TensorAllgatherer",
        "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "RankFailedError", "RankLeftError",
    ]

    init()
