"""Each rank's share of its node's devices for the framework that computes its steps: its own GPU
where there is one per rank, else CPU threads (as many as its own cores where it bound itself to
them). What each framework needs is its backend's `devices.py`, called through the step class's
`configure_devices` once, when the rank starts, before the framework first uses a device."""

import logging
import os

from tarantella.common import config

logger = logging.getLogger("tarantella")


def threads_of_rank(share):
    """How many CPU threads a rank (its place on the node: `share`, a NodeShare) computes with, or
    None for the frameworks' defaults: TNT_THREADS_PER_RANK, else its share of the node's cores
    where several ranks run on the node."""
    threads = config.threads_per_rank()
    if threads is None and share.local_size > 1:
        # Measured on 2 cores: one thread per rank beats TensorFlow's defaults by 25%.
        cores = len(os.sched_getaffinity(0))
        threads = cores if share.bound_to_own_cores else max(1, cores // share.local_size)
    return threads


def gpu_of_this_rank(local_rank, local_size, gpus):
    """The index of this rank's GPU among the node's `gpus`, or None where it trains on CPU. Ranks
    sharing a GPU that each took all its memory would run out of it, so with fewer GPUs than ranks
    every rank trains on CPU (with a warning, unless the job asked for CPUs), unless TNT_SHARE_GPUS
    lets them share."""
    if not gpus or not config.use_gpu():
        return None
    if local_size <= gpus or config.share_gpus():
        return local_rank % gpus
    logger.warning("%d ranks on this node but %d GPU(s): every rank runs on CPU (TNT_SHARE_GPUS=true lets them "
                   "share the GPUs).", local_size, gpus)
    return None
