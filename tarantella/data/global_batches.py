"""The user's inputs as datasets of global batches: a tf.data dataset batched or not, arrays with
tarantella's seeded shuffle (where Keras' would differ per rank), and counting batches."""

import numpy as np
import tensorflow as tf
# Keras' array adapter and its conversions, for arrays tarantella shuffles itself
# (seeded_shuffle_of_arrays); tests/test_keras_internals.py checks them.
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing

from tarantella.common import config
from tarantella.data.pipelines import global_batch_size
from tarantella.data.rebuild import BATCHES, INTERLEAVES, REAPPLY


# Transformations that keep elements batched, or unbatched, as their input was.
_KEEPS_BATCHING = set(REAPPLY) - set(BATCHES) - set(INTERLEAVES) | {"_ShardDataset", "_IgnoreErrorsDataset",
                                                   "_ConcatenateDataset"}


# Sources of single samples (`from_tensors` is not one: its one element may be a whole batch).
_SAMPLE_SOURCES = {"_TensorSliceDataset", "_RangeDataset", "TFRecordDatasetV2", "TextLineDatasetV2",
                   "_FixedLengthRecordDatasetV2"}


def is_batched(dataset):
    """Whether the elements are batches. A transformation we do not know counts as batching."""
    node = dataset
    while type(node).__name__ in _KEEPS_BATCHING:
        node = node._input_dataset
    name = type(node).__name__
    return name not in _SAMPLE_SOURCES and name != "_UnbatchDataset"


def global_batches(method, dataset, micro_batch_size=None, ranks=1):
    """The user's tf.data.Dataset as a dataset of global batches: as it is, or batched with
    tnt_micro_batch_size x `ranks` (the number of ranks when tarantella distributes the data, 1
    when each rank passes its own shard) where it yields single samples."""
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or
                                         not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"tnt_micro_batch_size must be a positive integer; got {micro_batch_size!r}.")
    wanted = None if micro_batch_size is None else micro_batch_size * ranks
    if not is_batched(dataset):
        if wanted is None:
            raise ValueError(
                "The dataset is not batched: its elements are single samples. Batch it with the global "
                "batch size, e.g. dataset.batch(64), or pass tnt_micro_batch_size= and tarantella batches "
                "it with micro-batch x ranks.")
        return dataset.batch(wanted)
    if wanted is not None:
        batch = global_batch_size(dataset)
        if batch is not None and batch != wanted:
            raise ValueError(
                f"The dataset is batched with {batch} samples, but tnt_micro_batch_size={micro_batch_size} "
                f"x {ranks} ranks = {wanted}. Batch it with {wanted}, or leave it unbatched and let "
                "tnt_micro_batch_size batch it.")
    return dataset


def refuse_separate_arrays(method, y, sample_weight, batch_size):
    """A tf.data.Dataset carries its labels and weights, and is batched already."""
    if y is not None or sample_weight is not None:
        raise ValueError(f"tnt.Model.{method}: with a tf.data.Dataset, labels and sample weights belong inside "
                         "its elements, as (x, y) or (x, y, sample_weight); do not pass y= or sample_weight=.")
    if batch_size is not None:
        raise ValueError(
            f"tnt.Model.{method}: batch_size={batch_size} cannot be combined with a tf.data.Dataset, which is "
            "batched already (with the global batch size). Remove batch_size=, or pass an unbatched "
            "dataset with tnt_micro_batch_size=.")


def seeded_shuffle_of_arrays(x, y, sample_weight, batch_size, shuffle, class_weight):
    """Arrays as a dataset of global batches in an order drawn from tarantella's fixed seed, new
    each epoch (keras_batches.needs_own_shuffle: TensorFlow without a global seed, where Keras'
    own order cannot be drawn alike on every rank). Keras' adapter still checks the arrays, turns
    `class_weight` into sample weights and converts the arrays; shuffle="batch" permutes the rows
    within each batch, as Keras does."""
    adapter = array_data_adapter.ArrayDataAdapter(x, y, sample_weight, batch_size=batch_size,
                                                  class_weight=class_weight)
    arrays = array_slicing.convert_to_sliceable(adapter._inputs, target_backend="tensorflow")
    arrays = tf.nest.map_structure(tf.convert_to_tensor, tuple(arrays) if isinstance(arrays, list) else arrays)
    samples = tf.data.Dataset.range(adapter._num_samples)
    if shuffle == "batch":
        indices = samples.batch(adapter.batch_size).enumerate().map(
            lambda number, batch: tf.gather(batch, tf.random.experimental.stateless_shuffle(
                tf.range(tf.size(batch)), seed=[config.DEFAULT_SHUFFLE_SEED, number])))
    else:
        indices = samples.shuffle(adapter._num_samples, seed=config.DEFAULT_SHUFFLE_SEED).batch(adapter.batch_size)
    return indices.map(lambda rows: tf.nest.map_structure(lambda array: tf.gather(array, rows), arrays))


def count_batches(dataset):
    """Batches in one pass over the dataset (-1: endless); counts by iterating if TF cannot tell."""
    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(dataset.reduce(np.int64(0), lambda counted, _: counted + 1))
    return count
