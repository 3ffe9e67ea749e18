"""Inputs that Keras batches itself (arrays, `keras.utils.PyDataset`, torch `DataLoader`): Keras' own
data adapter draws every global batch on every rank, and each step keeps the rank's rows.

Serial Keras' order is whatever its adapter for the backend draws: on TensorFlow a `tf.random.shuffle`
inside its pipeline (the same order every epoch once the script sets a seed), on JAX NumPy's global
generator, on PyTorch torch's default generator, for a PyDataset Python's `random`, each drawn when
Keras creates or first reads an iterator, and a PyDataset's own `on_epoch_begin`/`on_epoch_end`
hooks (which often shuffle with NumPy) called in between. Rather than imitate this, tarantella hands
such inputs to Keras unchanged, with the global batch size: every rank runs serial Keras' own
adapter, so every rank draws serial Keras' order, and the step takes rows rank, rank + p, ... of each
global batch (`data.rows_of_rank`). For the draws to agree where the script sets no seed, every rank
takes the master's generator states before the adapter draws (`use_masters_random_state`).

Two things remain to match serial Keras, both done here: Keras-on-JAX and on-torch build an unbuilt
model (or its compiled metrics) from one batch of the fit's own iterator, which draws a pass of its
own (`build_as_keras_does`), and a fit resumed from a backup must first replay the passes of the
epochs it skips (`replay_passes`).

The exception is TensorFlow without a global seed: each process's `tf.random.shuffle` then draws its
own order, which the others cannot know, so shuffled arrays go through tarantella's own seeded
tf.data shuffle instead (`needs_own_shuffle`).
"""

import random
import sys

import keras
import numpy as np
import tensorflow as tf
# Keras' test of whether it slices an input as arrays; tests/test_keras_internals.py checks it.
from keras.src.trainers.data_adapters import array_data_adapter

from tarantella import backends


def is_torch_data_loader(x):
    """Whether `x` is a torch.utils.data.DataLoader (without importing torch where it is not in use)."""
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and isinstance(x, torch_data.DataLoader)


def is_batched_by_keras(x, y=None, sample_weight=None):
    """Whether Keras' own adapter batches this input: arrays (NumPy, tensors, pandas, ...), a
    PyDataset or a torch DataLoader."""
    if isinstance(x, tf.data.Dataset):
        return False
    if isinstance(x, keras.utils.PyDataset) or is_torch_data_loader(x):
        return True
    return x is not None and array_data_adapter.can_convert_arrays((x, y, sample_weight))


def refuse_unknown_input(method, x):
    """The error for an input that is neither a tf.data.Dataset nor batched by Keras' adapters."""
    raise TypeError(
        f"tnt.Model.{method} takes a tf.data.Dataset, arrays (NumPy or tensors, or dicts/lists of them), a "
        f"keras.utils.PyDataset or a torch DataLoader; got {type(x).__name__}. Every rank must see the same "
        "global batches, which a Python generator cannot promise: wrap it in a PyDataset of known length, or "
        "in tf.data.Dataset.from_generator(...).batch(global_batch_size).")


def needs_own_shuffle(x, shuffle):
    """Whether shuffled arrays must use tarantella's seeded shuffle: on TensorFlow without a global
    TensorFlow seed, Keras' `tf.random.shuffle` draws a different order in every process."""
    shuffled_arrays = bool(shuffle) and not isinstance(x, keras.utils.PyDataset) and not is_torch_data_loader(x)
    return (shuffled_arrays and backends.step_class().keras_array_shuffle_differs_per_process
            and tf.compat.v1.get_seed(None)[0] is None)


def keras_batch_size(method, x, batch_size, micro_batch_size, ranks):
    """The batch size to give Keras: `batch_size`, or tnt_micro_batch_size x ranks; None for inputs
    that come in batches (a PyDataset's or a DataLoader's own)."""
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or
                                         not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"tnt_micro_batch_size must be a positive integer; got {micro_batch_size!r}.")
    if isinstance(x, keras.utils.PyDataset) or is_torch_data_loader(x):
        kind = "a keras.utils.PyDataset" if isinstance(x, keras.utils.PyDataset) else "a torch DataLoader"
        if batch_size is not None or micro_batch_size is not None:
            raise ValueError(
                f"tnt.Model.{method}: {kind} makes its own batches, which are the global batches: remove "
                f"{'batch_size=' if batch_size is not None else 'tnt_micro_batch_size='} and give it batches of "
                "the global batch size.")
        return None
    if micro_batch_size is None:
        return batch_size
    wanted = micro_batch_size * ranks
    if batch_size is not None and batch_size != wanted:
        raise ValueError(
            f"batch_size={batch_size} is the global batch, but tnt_micro_batch_size={micro_batch_size} "
            f"x {ranks} ranks = {wanted}. Pass one of the two.")
    return wanted


def batch_count(x, y, sample_weight, batch_size, steps):
    """Batches Keras makes of the input in one pass (-1 where it cannot tell)."""
    if isinstance(x, keras.utils.PyDataset):
        return -1 if x.num_batches is None else x.num_batches
    if is_torch_data_loader(x):
        try:
            return len(x)
        except TypeError:
            return -1
    if steps and not batch_size:
        return steps
    count = len(tf.nest.flatten(x)[0])
    return -(-count // (batch_size or 32))


def use_masters_random_state(comm):
    """Every rank takes the master's state of the generators Keras' adapters and the user's
    PyDataset hooks draw orders from (NumPy's, Python's, torch's): where the script seeds them,
    the states are equal already; where it does not, all ranks now draw the master's orders."""
    states = {"numpy": np.random.get_state(), "python": random.getstate()}
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.get_rng_state().numpy()
    masters = comm.broadcast_object(states, "the broadcast of the master's random generator states")
    np.random.set_state(masters["numpy"])
    random.setstate(masters["python"])
    if torch is not None:
        torch.set_rng_state(torch.from_numpy(masters["torch"]))


def needs_build(model):
    """Keras' own test, in its trainers' `_symbolic_build`, of whether fit or evaluate first build the
    model from one batch of their iterator (an unbuilt layer, compiled metrics or loss)."""
    unbuilt = [state for state in (model._compile_metrics, model._compile_loss)
               if state is not None and not state.built]
    return bool(unbuilt) or not all(layer.built for layer in model._flatten_layers())


def build_as_keras_does(model, epoch_iterator):
    """Builds `model` as Keras-on-JAX's and on-torch's fit and evaluate would from their
    `epoch_iterator`: from the first batch of one pass of it, which serial Keras draws too."""
    if not needs_build(model):
        return
    for _, _, batches in epoch_iterator:
        batch = batches[0] if isinstance(batches, (list, tuple)) else next(batches)
        break
    else:
        raise ValueError("The input holds no batches, so the model cannot be built from it.")
    model._symbolic_build(data_batch=batch)


def spec_of(batch):
    """The tf.TensorSpec structure of a batch of any backend's arrays, its batch dimension open."""
    def spec(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, (tf.TensorSpec, tf.RaggedTensorSpec)):
            return leaf
        shape = tuple(leaf.shape)
        return tf.TensorSpec((None,) + shape[1:], keras.backend.standardize_dtype(leaf.dtype))

    return tf.nest.map_structure(spec, batch)


def first_batch_spec(x, y, sample_weight):
    """The spec of the input's batches, for building an unbuilt model before predict or evaluate.
    Arrays are read without slicing; a PyDataset gives its batch 0, a DataLoader its first batch
    (drawn with torch's generator left as it was)."""
    if isinstance(x, keras.utils.PyDataset):
        return spec_of(x[0])
    if is_torch_data_loader(x):
        import torch

        with torch.random.fork_rng(devices=[]):
            return spec_of(next(iter(x)))
    return spec_of(keras.utils.pack_x_y_sample_weight(*(tuple(a) if isinstance(a, list) else a
                                                        for a in (x, y, sample_weight))))


def replay_passes(epoch_iterator, passes):
    """Draws what `passes` earlier epochs of an uninterrupted fit drew from Keras' `epoch_iterator`:
    per epoch, the adapter's epoch hooks, the iterator the epoch read (its first batch: some draw
    only then) and, where the number of batches is known, the one Keras makes for the next epoch
    as soon as an epoch has seen them all (tests/test_keras_internals.py checks both)."""
    adapter = epoch_iterator.data_adapter
    for _ in range(passes):
        adapter.on_epoch_begin()
        next(iter(epoch_iterator._get_iterator()), None)
        if epoch_iterator.num_batches:
            iter(epoch_iterator._get_iterator())
        adapter.on_epoch_end()
