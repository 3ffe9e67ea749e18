"""JAX's device on a rank: its own GPU, or the CPU."""

import os

import jax

from tarantella.backends.devices import gpu_of_this_rank
from tarantella.common.hardware import count_gpus


def configure(share):
    """JAX's devices must be chosen before it first uses them (its backends start lazily)."""
    gpus = count_gpus()
    gpu = gpu_of_this_rank(share.local_rank, share.local_size, gpus)
    if gpu is None:
        jax.config.update("jax_platforms", "cpu")
        return
    jax.config.update("jax_cuda_visible_devices", str(gpu))
    if share.local_size > gpus:  # by default JAX takes 75% of its GPU's memory when it starts
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
