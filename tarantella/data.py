"""Splits every global batch of a tf.data pipeline across the ranks, sample by sample.

Rank r of p takes rows r, r+p, r+2p, ... of each global batch. Micro-batch sizes
therefore differ by at most one, a last incomplete batch splits by the same rule,
and every rank runs the same number of steps (a rank may get an empty micro-batch
when a batch has fewer samples than there are ranks; it then contributes nothing).

All ranks walk the same sample sequence, so shuffles must be seeded alike: a shuffle
without a seed gets a fixed default one. Per-sample `map`s placed directly before
`batch` run, on each rank, only for the samples it owns; the others are replaced by
zero placeholders that never leave the rank's global batch view.
"""

import logging

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.data.util import structure
from tensorflow.python.framework import random_seed

from tarantella import communication, config

logger = logging.getLogger("tarantella")

_MAPS = ("_MapDataset", "_ParallelMapDataset")
_BATCHES = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")
# Op types that draw from per-process random state, or change variables: a map holding
# one must see every sample on every rank to draw the same numbers as a serial run.
_STATEFUL_OP_PREFIXES = ("Random", "StatefulUniform", "StatefulStandardNormal",
                         "StatefulTruncatedNormal", "StatefulRandom")
_STATEFUL_OPS = {"Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal", "RngSkip",
                 "RngReadAndSkip", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                 "PyFunc", "PyFuncStateless", "EagerPyFunc"}


def micro_batch_size(global_batch_size, rank, size):
    """Number of rows of a global batch that `rank` processes."""
    return global_batch_size // size + (1 if rank < global_batch_size % size else 0)


def distribute(dataset, rank=None, size=None):
    """Returns the dataset of rank `rank` (default: this process's): its micro-batches, one per global batch."""
    if rank is None or size is None:
        comm = communication.init()
        rank, size = comm.rank, comm.size
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"tarantella distributes tf.data.Dataset inputs; got {type(dataset).__name__}. "
            "Build one with tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).")
    _check_batched(dataset)
    chain = _rebuildable_chain(dataset)
    _check_seeds_outside(chain[0]._input_dataset if chain else dataset)
    batch_index = _global_batch_index(chain)
    global_batch = _static_batch_size(chain, batch_index)
    if global_batch is not None and global_batch < size:
        logger.warning(
            "The global batch size (%d) is smaller than the number of ranks (%d): ranks %d to %d "
            "get no samples and idle. Use a global batch of at least %d.",
            global_batch, size, global_batch, size - 1, size)
    if size == 1:  # only the shuffle seeds change, so one rank sees what N ranks see together
        return _rebuild(dataset, chain, [], rank, size)
    split = _splittable_maps(chain, batch_index)
    distributed = _rebuild(dataset, chain, split, rank, size)
    if dataset.options().deterministic is False:
        options = tf.data.Options()
        options.deterministic = True
        distributed = distributed.with_options(options)
    return distributed.map(_rows_of_rank(dataset.element_spec, rank, size))


def _check_batched(dataset):
    for spec in tf.nest.flatten(dataset.element_spec):
        if not isinstance(spec, (tf.TensorSpec, tf.RaggedTensorSpec)):
            raise TypeError(f"tarantella cannot split dataset elements of type {type(spec).__name__}; "
                            "convert them to dense or ragged tensors.")
        if spec.shape.rank == 0:
            raise ValueError(
                "The dataset is not batched: its elements are single samples. Batch it with the "
                "global batch size, e.g. dataset.batch(64); tarantella splits each batch across ranks.")


def _rebuildable_chain(dataset):
    """The transformations from the output down to the first one we cannot re-apply, bottom first."""
    chain = []
    node = dataset
    while type(node).__name__ in _REAPPLY:
        chain.append(node)
        node = node._input_dataset
    return chain[::-1]


def _global_batch_index(chain):
    for index in reversed(range(len(chain))):
        if type(chain[index]).__name__ in _BATCHES:
            return index
    return None


def global_batch_size(dataset):
    """The batch size of the pipeline's last `batch` when it is a constant, else None."""
    chain = _rebuildable_chain(dataset)
    return _static_batch_size(chain, _global_batch_index(chain))


def _static_batch_size(chain, batch_index):
    """The global batch size, if the pipeline's last `batch` has a constant one."""
    if batch_index is None:
        return None
    value = tf.get_static_value(chain[batch_index]._batch_size)
    return None if value is None else int(value)


def _splittable_maps(chain, batch_index):
    """Positions of the maps right below the global batch that may run on owned samples only."""
    if _static_batch_size(chain, batch_index) is None or \
            type(chain[batch_index]).__name__ == "_PaddedBatchDataset":
        return []
    feeding_batch = chain[batch_index]._input_dataset.element_spec
    if not all(isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined()
               for spec in tf.nest.flatten(feeding_batch)):
        return []  # a placeholder for a skipped sample needs a known shape
    split = []
    index = batch_index - 1
    while index >= 0 and type(chain[index]).__name__ in _MAPS and _is_pure(chain[index]._map_func):
        split.insert(0, index)
        index -= 1
    return split


def _is_pure(function_wrapper):
    graph_def = function_wrapper.function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for library_function in graph_def.library.function:
        nodes.extend(library_function.node_def)
    return not any(node.op in _STATEFUL_OPS or node.op.startswith(_STATEFUL_OP_PREFIXES)
                   for node in nodes)


def _shuffle_seeds(node):
    return int(tf.get_static_value(node._seed)), int(tf.get_static_value(node._seed2))


def _is_unseeded_shuffle(node):
    # TensorFlow stores (0, 0) for "no seed": a fresh random order in every process.
    return type(node).__name__ == "_ShuffleDataset" and _shuffle_seeds(node) == (0, 0)


def _check_seeds_outside(untouched):
    """Shuffles we cannot rebuild must already be seeded, or ranks would disagree on the order."""
    pending, seen = [untouched], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if _is_unseeded_shuffle(node):
            raise ValueError(
                "The dataset shuffles without a seed below a transformation tarantella cannot rebuild "
                f"({type(untouched).__name__.strip('_')}). Every rank must shuffle alike: pass a seed, "
                "e.g. dataset.shuffle(buffer_size, seed=42).")
        if getattr(node, "_deterministic", None) == "false":
            raise ValueError(
                f"A {type(node).__name__.strip('_')} transformation runs with deterministic=False, so "
                "ranks could see samples in different orders. Remove deterministic=False.")
        pending.extend(node._inputs())


def _rebuild(dataset, chain, split, rank, size):
    """Re-applies the chain from the lowest transformation that must change."""
    must_change = [i for i, node in enumerate(chain)
                   if _is_unseeded_shuffle(node) or getattr(node, "_deterministic", None) == "false"]
    first = min(must_change + split[:1], default=None)
    if first is None:
        return dataset
    rebuilt = chain[first]._input_dataset
    index = first
    while index < len(chain):
        if split and index == split[0]:
            batch_size = _static_batch_size(chain, split[-1] + 1)
            rebuilt = _map_owned_samples(rebuilt, [chain[i] for i in split], batch_size, rank, size)
            index = split[-1] + 1
            continue
        rebuilt = _REAPPLY[type(chain[index]).__name__](chain[index], rebuilt)
        index += 1
    return rebuilt


def _map_owned_samples(dataset, maps, batch_size, rank, size):
    functions = [_reuse(node._map_func) for node in maps]
    output_spec = maps[-1].element_spec
    placeholder = lambda: tf.nest.map_structure(_zeros_like_spec, output_spec)

    def run_maps(element):
        for function in functions:
            element = function(*element) if isinstance(element, tuple) else function(element)
        return element

    @tf.autograph.experimental.do_not_convert
    def owned_or_placeholder(position, element):
        owned = tf.equal(position % batch_size % size, rank)
        return tf.cond(owned, lambda: run_maps(element), placeholder)

    parallel = [node._num_parallel_calls for node in maps if hasattr(node, "_num_parallel_calls")]
    return dataset.enumerate().map(owned_or_placeholder,
                                   num_parallel_calls=parallel[-1] if parallel else None,
                                   deterministic=True if parallel else None)


def _zeros_like_spec(spec):
    if spec.dtype == tf.string:
        return tf.fill(spec.shape, "")
    return tf.zeros(spec.shape, spec.dtype)


def _reuse(function_wrapper):
    """A callable for Dataset.map/filter that runs an already traced tf.data function."""
    concrete = function_wrapper.function
    input_structure = function_wrapper._input_structure
    output_structure = function_wrapper.output_structure

    @tf.autograph.experimental.do_not_convert
    def call(*args):
        element = args if isinstance(input_structure, tuple) else args[0]
        outputs = concrete(*structure.to_tensor_list(input_structure, element))
        return structure.from_tensor_list(output_structure, tf.nest.flatten(outputs))

    return call


def _rows_of_rank(element_spec, rank, size):
    def take_rows(tensor):
        if isinstance(tensor, tf.RaggedTensor):
            return tf.gather(tensor, tf.range(rank, tensor.nrows(), size))
        return tensor[rank::size]

    @tf.autograph.experimental.do_not_convert
    def rows(*args):
        element = args if isinstance(element_spec, tuple) else args[0]
        return tf.nest.map_structure(take_rows, element)

    return rows


def _reapply_shuffle(node, dataset):
    seeds = _shuffle_seeds(node)
    op_seed = config.DEFAULT_SHUFFLE_SEED if seeds == (0, 0) else seeds[1]
    if seeds != (0, 0) and random_seed.get_seed(op_seed) != seeds:
        raise ValueError(
            "A seeded shuffle cannot be rebuilt because tf.random.set_seed changed after the dataset "
            "was made. Create the dataset after setting the global seed.")
    return dataset.shuffle(node._buffer_size, seed=op_seed,
                           reshuffle_each_iteration=node._reshuffle_each_iteration)


def _reapply_map(node, dataset):
    parallel = getattr(node, "_num_parallel_calls", None)
    return dataset.map(_reuse(node._map_func), num_parallel_calls=parallel,
                       deterministic=True if parallel is not None else None)


def _reapply_batch(node, dataset):
    if type(node).__name__ == "_PaddedBatchDataset":
        return dataset.padded_batch(node._batch_size, padded_shapes=node._padded_shapes,
                                    padding_values=node._padding_values,
                                    drop_remainder=node._drop_remainder)
    parallel = getattr(node, "_num_parallel_calls", None)
    return dataset.batch(node._batch_size, drop_remainder=node._drop_remainder,
                         num_parallel_calls=parallel, deterministic=True if parallel is not None else None)


def _static(tensor):
    """A transformation's argument as a Python value where it is a constant (some ops need one)."""
    value = tf.get_static_value(tensor)
    return tensor if value is None else value.item()


_REAPPLY = {
    "_MapDataset": _reapply_map,
    "_ParallelMapDataset": _reapply_map,
    "_FilterDataset": lambda node, ds: ds.filter(_reuse(node._predicate)),
    "_ShuffleDataset": _reapply_shuffle,
    "_BatchDataset": _reapply_batch,
    "_ParallelBatchDataset": _reapply_batch,
    "_PaddedBatchDataset": _reapply_batch,
    "_RepeatDataset": lambda node, ds: ds.repeat(_static(node._count)),
    "_TakeDataset": lambda node, ds: ds.take(_static(node._count)),
    "_SkipDataset": lambda node, ds: ds.skip(_static(node._count)),
    "CacheDataset": lambda node, ds: ds.cache(node._filename),
    "_PrefetchDataset": lambda node, ds: ds.prefetch(_static(node._buffer_size)),
    "_OptionsDataset": lambda node, ds: ds.with_options(node._options),
}


# -- user inputs as datasets of global batches ---------------------------------------------

# Transformations that keep elements batched, or unbatched, as their input was.
_KEEPS_BATCHING = set(_REAPPLY) - set(_BATCHES) | {"_ShardDataset", "_IgnoreErrorsDataset",
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


def global_batches(method, x, y=None, sample_weight=None, batch_size=None, micro_batch_size=None,
                   ranks=1, shuffle=False):
    """The user's input as a tf.data.Dataset of global batches.

    `ranks` is how many micro-batches make a global batch: the number of ranks when tarantella
    distributes the data, 1 when each rank passes its own shard. Datasets, NumPy arrays (and
    dicts or tuples of them, and tensors) and keras.utils.PyDataset are accepted."""
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or
                                         not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"tnt_micro_batch_size must be a positive integer; got {micro_batch_size!r}.")
    wanted = None if micro_batch_size is None else micro_batch_size * ranks
    if isinstance(x, tf.data.Dataset):
        _refuse_separate_arrays(method, "a tf.data.Dataset", y, sample_weight, batch_size)
        return _batched_as_asked(x, wanted, micro_batch_size, ranks)
    if isinstance(x, keras.utils.PyDataset):
        _refuse_separate_arrays(method, "a keras.utils.PyDataset", y, sample_weight, batch_size)
        return _from_py_dataset(x, wanted, micro_batch_size, ranks, shuffle)
    if not _is_arrays(x):
        raise TypeError(
            f"tnt.Model.{method} takes a tf.data.Dataset, NumPy arrays (or dicts/tuples of them) or a "
            f"keras.utils.PyDataset; got {type(x).__name__}. Wrap generators in a PyDataset or "
            "tf.data.Dataset.from_generator(...).batch(global_batch_size).")
    if wanted is not None and batch_size is not None and batch_size != wanted:
        raise ValueError(
            f"batch_size={batch_size} is the global batch, but tnt_micro_batch_size={micro_batch_size} "
            f"x {ranks} ranks = {wanted}. Pass one of the two.")
    samples = keras.utils.pack_x_y_sample_weight(*(_as_tuples(a) for a in (x, y, sample_weight)))
    dataset = tf.data.Dataset.from_tensor_slices(samples)
    if shuffle is True:  # Keras draws an unseeded order; ours is seeded, so all ranks draw alike
        dataset = dataset.shuffle(int(dataset.cardinality()), seed=config.DEFAULT_SHUFFLE_SEED)
    dataset = dataset.batch(wanted or batch_size or 32)
    if shuffle == "batch":
        dataset = dataset.shuffle(int(dataset.cardinality()), seed=config.DEFAULT_SHUFFLE_SEED)
    return dataset


def split_for_validation(x, y, sample_weight, fraction):
    """Keras' validation_split: the last `fraction` of the samples, taken before shuffling."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_split must be between 0 and 1; got {fraction}.")
    count = len(tf.nest.flatten(x)[0])
    split_at = int(count * (1.0 - fraction))
    def rows(selection):
        return tuple(None if a is None else tf.nest.map_structure(lambda t: t[selection], _as_tuples(a))
                     for a in (x, y, sample_weight))

    return rows(slice(None, split_at)), rows(slice(split_at, None))


def count_batches(dataset):
    """Batches in one pass over the dataset (-1: endless); counts by iterating if TF cannot tell."""
    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(dataset.reduce(np.int64(0), lambda counted, _: counted + 1))
    return count


def _refuse_separate_arrays(method, kind, y, sample_weight, batch_size):
    if y is not None or sample_weight is not None:
        raise ValueError(f"tnt.Model.{method}: with {kind}, labels and sample weights belong inside its "
                         "elements, as (x, y) or (x, y, sample_weight); do not pass y= or sample_weight=.")
    if batch_size is not None:
        raise ValueError(
            f"tnt.Model.{method}: batch_size={batch_size} cannot be combined with {kind}, which is "
            "batched already (with the global batch size). Remove batch_size=, or pass an unbatched "
            "dataset with tnt_micro_batch_size=.")


def _batched_as_asked(dataset, wanted, micro_batch_size, ranks):
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


def _from_py_dataset(py_dataset, wanted, micro_batch_size, ranks, shuffle):
    batches = py_dataset.num_batches
    if batches is None:
        raise ValueError("tarantella needs a PyDataset with a known length (num_batches); an endless one "
                         "cannot be split into the same number of steps on every rank.")
    first = py_dataset[0]
    first_size = len(tf.nest.flatten(first)[0])
    if wanted is not None and first_size != wanted:
        raise ValueError(
            f"The PyDataset's batches hold {first_size} samples, but tnt_micro_batch_size={micro_batch_size} "
            f"x {ranks} ranks = {wanted}. Make its batches hold {wanted} samples.")
    signature = tf.nest.map_structure(
        lambda a: tf.TensorSpec((None,) + np.shape(a)[1:], tf.as_dtype(np.asarray(a).dtype)), first)

    epochs = iter(range(2**62))

    def generate():
        order = np.arange(batches)
        if shuffle:  # Keras shuffles the batch order each epoch; here seeded, alike on every rank
            np.random.default_rng([config.DEFAULT_SHUFFLE_SEED, next(epochs)]).shuffle(order)
        for index in order:
            yield py_dataset[int(index)]
        py_dataset.on_epoch_end()

    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    return dataset.apply(tf.data.experimental.assert_cardinality(batches))  # Keras then knows the steps


def _is_arrays(x):
    leaves = tf.nest.flatten(_as_tuples(x))
    return bool(leaves) and all(isinstance(a, (np.ndarray, tf.Tensor)) for a in leaves)


def _as_tuples(structure):
    """Keras reads a list of arrays as several inputs; tf.data would stack it into one tensor."""
    return tuple(structure) if isinstance(structure, list) else structure
