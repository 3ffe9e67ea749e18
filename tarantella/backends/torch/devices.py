"""torch's device and threads on a rank: on Keras' PyTorch backend the step's compute is torch's."""

import torch
# Keras' torch backend chose its device when it was imported (before MPI told this rank which
# GPU is its own); tests/test_torch_backend.py checks that it still reads it from here.
from keras.src.backend.torch import core as keras_torch_core

from tarantella.backends.devices import gpu_of_this_rank


def configure(share, threads):
    """The rank's own GPU, else its share of the node's cores instead of every core for every rank."""
    gpu = gpu_of_this_rank(share.local_rank, share.local_size, torch.cuda.device_count())
    if gpu is not None:
        torch.cuda.set_device(gpu)
        keras_torch_core.DEFAULT_DEVICE = f"cuda:{gpu}"
    else:
        keras_torch_core.DEFAULT_DEVICE = "cpu"
    if threads:
        torch.set_num_threads(threads)
