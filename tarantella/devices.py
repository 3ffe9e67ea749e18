"""Each rank's share of its node's devices for the framework that computes its steps: its own GPU
where there is one per rank, else CPU threads (as many as its own cores where it bound itself to
them). Runs once, when the rank starts, before the framework first uses a device."""

import logging
import os
import sys

from tarantella.common import config
from tarantella.common.hardware import count_gpus

logger = logging.getLogger("tarantella")


def configure(share):
    """Configures the devices of this rank, whose place on its node is `share` (a NodeShare)."""
    _configure_devices(share.local_rank, share.local_size, share.bound_to_own_cores)



def _configure_devices(local_rank, local_size, bound_to_own_cores):
    """Gives each rank its share of the node: its own GPU if there is one per rank, else CPU threads
    (as many as its own cores, where it bound itself to them). On Keras' JAX and torch backends
    the GPU goes to JAX or torch, and TensorFlow, there only for the input pipeline, gets none."""
    import tensorflow as tf
    keras = sys.modules.get("keras")
    backend = keras.backend.backend() if keras is not None else "tensorflow"
    threads = config.threads_per_rank()
    if threads is None and local_size > 1:
        # Measured on 2 cores: one thread per rank beats TensorFlow's defaults by 25%.
        cores = len(os.sched_getaffinity(0))
        threads = cores if bound_to_own_cores else max(1, cores // local_size)
    try:
        gpus = tf.config.list_physical_devices("GPU")
        gpu = _gpu_of_this_rank(local_rank, local_size, len(gpus)) if backend == "tensorflow" else None
        if gpu is not None:
            tf.config.set_visible_devices([gpus[gpu]], "GPU")
            tf.config.experimental.set_memory_growth(gpus[gpu], True)
        elif gpus:
            tf.config.set_visible_devices([], "GPU")
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow started before tarantella was imported
        logger.warning("TensorFlow was already running when tarantella was imported, so this rank keeps "
                       "TensorFlow's default devices and threads and may compete with %d other rank(s) on "
                       "this node. Import tarantella before using TensorFlow.", local_size - 1)
    if backend == "jax":
        _configure_jax(local_rank, local_size)
    elif backend == "torch":
        _configure_torch(local_rank, local_size, threads)


def _gpu_of_this_rank(local_rank, local_size, gpus):
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


def _configure_jax(local_rank, local_size):
    """JAX's devices must be chosen before it first uses them (its backends start lazily)."""
    import jax
    gpus = count_gpus()
    gpu = _gpu_of_this_rank(local_rank, local_size, gpus)
    if gpu is None:
        jax.config.update("jax_platforms", "cpu")
        return
    jax.config.update("jax_cuda_visible_devices", str(gpu))
    if local_size > gpus:  # by default JAX takes 75% of its GPU's memory when it starts
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _configure_torch(local_rank, local_size, threads):
    """On Keras' PyTorch backend the step's compute is torch's: the rank's own GPU, else its share
    of the node's cores instead of every core for every rank."""
    import torch
    # Keras' torch backend chose its device when it was imported (before MPI told this rank which
    # GPU is its own); tests/test_torch_backend.py checks that it still reads it from here.
    from keras.src.backend.torch import core as keras_torch_core
    gpu = _gpu_of_this_rank(local_rank, local_size, torch.cuda.device_count())
    if gpu is not None:
        torch.cuda.set_device(gpu)
        keras_torch_core.DEFAULT_DEVICE = f"cuda:{gpu}"
    else:
        keras_torch_core.DEFAULT_DEVICE = "cpu"
    if threads:
        torch.set_num_threads(threads)
