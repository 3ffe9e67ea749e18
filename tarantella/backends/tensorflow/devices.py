"""TensorFlow's devices and threads on a rank; TensorFlow runs the input pipeline on every backend."""

import logging

import tensorflow as tf

from tarantella.backends.devices import gpu_of_this_rank

logger = logging.getLogger("tarantella")


def configure(share, threads, computes_steps):
    """Gives TensorFlow the rank's GPU where it computes the steps (`computes_steps`) and there is
    one for the rank, else none; and `threads` threads (None: TensorFlow's default)."""
    try:
        gpus = tf.config.list_physical_devices("GPU")
        gpu = gpu_of_this_rank(share.local_rank, share.local_size, len(gpus)) if computes_steps else None
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
                       "this node. Import tarantella before using TensorFlow.", share.local_size - 1)
