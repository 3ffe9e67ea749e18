"""Walking and rebuilding a tf.data pipeline: its transformations from the source up, the seeds of
its shuffles and random maps (unseeded ones get a fixed seed, the same on every rank), and each
transformation applied again on a new input."""

import tensorflow as tf
from tensorflow.python.data.util import structure
from tensorflow.python.framework import random_seed

from tarantella.common import config


MAPS = ("_MapDataset", "_ParallelMapDataset")


BATCHES = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")


INTERLEAVES = ("_InterleaveDataset", "_ParallelInterleaveDataset")


# Sources that read a file's bytes for every sample they yield.
FILE_READERS = ("TFRecordDatasetV2", "TextLineDatasetV2", "_FixedLengthRecordDatasetV2")


# Op types that draw from per-process random state or change variables (Keras' random
# layers keep their seed in a variable): split across ranks, such a map draws per rank.
_RANDOM_OP_PREFIXES = ("Random", "StatefulUniform", "StatefulStandardNormal",
                       "StatefulTruncatedNormal", "StatefulRandom")


_RANDOM_OPS = {"Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal", "RngSkip",
               "RngReadAndSkip", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}


def node_name(node):
    return type(node).__name__.strip("_").replace("Dataset", "").replace("V2", "")


def nodes_below(dataset):
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) not in seen:
            seen.add(id(node))
            yield node
            pending.extend(node._inputs())


def draws_random_numbers(function_wrapper):
    graph_def = function_wrapper.function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for library_function in graph_def.library.function:
        nodes.extend(library_function.node_def)
    return any(node.op in _RANDOM_OPS or node.op.startswith(_RANDOM_OP_PREFIXES) for node in nodes)


def _shuffle_seeds(node):
    return int(tf.get_static_value(node._seed)), int(tf.get_static_value(node._seed2))


def _is_unseeded_shuffle(node):
    # TensorFlow stores (0, 0) for "no seed": a fresh random order in every process.
    return type(node).__name__ == "_ShuffleDataset" and _shuffle_seeds(node) == (0, 0)


def may_reorder(node):
    """Whether a transformation may deliver elements out of order (deterministic=False)."""
    if type(node).__name__ == "_ParallelInterleaveDataset":
        # TensorFlow keeps this flag only in the op: read it from the serialized pipeline.
        graph = tf.compat.v1.GraphDef.FromString(node._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
        flags = [n.attr["deterministic"].s for n in graph.node if n.op.startswith("ParallelInterleaveDataset")]
        return b"false" in flags
    return getattr(node, "_deterministic", None) == "false"


def check_seeds_outside(untouched):
    """Shuffles we cannot rebuild must already be seeded, or ranks would disagree on the order."""
    for node in nodes_below(untouched):
        if _is_unseeded_shuffle(node):
            raise ValueError(
                "The dataset shuffles without a seed below a transformation tarantella cannot rebuild "
                f"({type(untouched).__name__.strip('_')}). Every rank must shuffle alike: pass a seed, "
                "e.g. dataset.shuffle(buffer_size, seed=42).")
        if may_reorder(node):
            raise ValueError(
                f"A {node_name(node)} transformation runs with deterministic=False, so "
                "ranks could see samples in different orders. Remove deterministic=False.")


def _must_rebuild(node):
    # A parallel interleave is always rebuilt deterministic: cheaper than reading its flag.
    return _is_unseeded_shuffle(node) or type(node).__name__ == "_ParallelInterleaveDataset" or \
        getattr(node, "_deterministic", None) == "false"


def with_seeds(chain, stop, base, rebuild_all=False):
    """The dataset chain[stop - 1] (or `base`), re-applied from the lowest transformation that must
    change: a shuffle without a seed, or one that may deliver out of order (from `base`, if all)."""
    must_change = [0] if rebuild_all else [index for index in range(stop) if _must_rebuild(chain[index])]
    if not must_change or stop == 0:
        return chain[stop - 1] if stop else base
    rebuilt = base if rebuild_all else chain[must_change[0]]._input_dataset
    for node in chain[must_change[0]:stop]:
        rebuilt = REAPPLY[type(node).__name__](node, rebuilt)
    return rebuilt


def reuse(function_wrapper):
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
    return dataset.map(reuse(node._map_func), num_parallel_calls=parallel,
                       deterministic=True if parallel is not None else None)


def _reapply_batch(node, dataset):
    if type(node).__name__ == "_PaddedBatchDataset":
        return dataset.padded_batch(node._batch_size, padded_shapes=node._padded_shapes,
                                    padding_values=node._padding_values,
                                    drop_remainder=node._drop_remainder)
    parallel = getattr(node, "_num_parallel_calls", None)
    return dataset.batch(node._batch_size, drop_remainder=node._drop_remainder,
                         num_parallel_calls=parallel, deterministic=True if parallel is not None else None)


def static_value(tensor):
    """A transformation's argument as a Python value where it is a constant (some ops need one)."""
    value = tf.get_static_value(tensor)
    return tensor if value is None else value.item()


def _reapply_interleave(node, dataset):
    parallel = getattr(node, "_num_parallel_calls", None)
    return dataset.interleave(reuse(node._map_func), cycle_length=static_value(node._cycle_length),
                              block_length=static_value(node._block_length), num_parallel_calls=parallel,
                              deterministic=True if parallel is not None else None)


REAPPLY = {
    "_MapDataset": _reapply_map,
    "_ParallelMapDataset": _reapply_map,
    "_FilterDataset": lambda node, ds: ds.filter(reuse(node._predicate)),
    "_ShuffleDataset": _reapply_shuffle,
    "_BatchDataset": _reapply_batch,
    "_ParallelBatchDataset": _reapply_batch,
    "_PaddedBatchDataset": _reapply_batch,
    "_RepeatDataset": lambda node, ds: ds.repeat(static_value(node._count)),
    "_TakeDataset": lambda node, ds: ds.take(static_value(node._count)),
    "_SkipDataset": lambda node, ds: ds.skip(static_value(node._count)),
    "CacheDataset": lambda node, ds: ds.cache(node._filename),
    "_PrefetchDataset": lambda node, ds: ds.prefetch(static_value(node._buffer_size)),
    "_OptionsDataset": lambda node, ds: ds.with_options(node._options),
    "_InterleaveDataset": _reapply_interleave,
    "_ParallelInterleaveDataset": _reapply_interleave,
}
