"""Splits every global batch of a tf.data pipeline across the ranks, sample by sample.

Rank r of p takes rows r, r+p, r+2p, ... of each global batch. Micro-batch sizes
therefore differ by at most one, a last incomplete batch splits by the same rule,
and every rank runs the same number of steps (a rank may get an empty micro-batch
when a batch has fewer samples than there are ranks; it then contributes nothing).

All ranks walk the same sample sequence, so shuffles must be seeded alike: a shuffle
without a seed gets a fixed default one. The per-sample `map`s placed directly before
`batch` run, on each rank, only for the samples it owns, and each rank batches only
its own rows: the global batch is never built.
"""

import logging
import os
import struct

import keras
import numpy as np
import tensorflow as tf
# Keras' array adapter and its conversions, for arrays tarantella shuffles itself
# (seeded_shuffle_of_arrays); tests/test_keras_internals.py checks them.
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
from tensorflow.python.data.util import structure
from tensorflow.python.framework import random_seed

from tarantella import backends, keras_batches
from tarantella.common import config
from tarantella.runtime import world

logger = logging.getLogger("tarantella")

_MAPS = ("_MapDataset", "_ParallelMapDataset")
_BATCHES = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")
_INTERLEAVES = ("_InterleaveDataset", "_ParallelInterleaveDataset")
# Sources that read a file's bytes for every sample they yield.
_FILE_READERS = ("TFRecordDatasetV2", "TextLineDatasetV2", "_FixedLengthRecordDatasetV2")
# Op types that draw from per-process random state or change variables (Keras' random
# layers keep their seed in a variable): split across ranks, such a map draws per rank.
_RANDOM_OP_PREFIXES = ("Random", "StatefulUniform", "StatefulStandardNormal",
                       "StatefulTruncatedNormal", "StatefulRandom")
_RANDOM_OPS = {"Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal", "RngSkip",
               "RngReadAndSkip", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}
_said = set()


def _info_once(message, *args):
    text = message % args
    if text not in _said:
        _said.add(text)
        logger.info(text)


def micro_batch_size(global_batch_size, rank, size):
    """Number of rows of a global batch that `rank` processes."""
    return global_batch_size // size + (1 if rank < global_batch_size % size else 0)


def distribute(dataset, rank=None, size=None):
    """Returns the dataset of rank `rank` (default: this process's): its micro-batches, one per global batch.

    Rank r of p gets rows r, r + p, r + 2p, ... of each global batch, as `tnt.Model.fit` does, and
    every rank gets the same number of batches (some may be empty). A shuffle without any seed
    gets a fixed one, so that every rank draws the same order.

    Args:
        dataset: a `tf.data.Dataset` batched with the global batch size.
        rank, size: the rank and number of ranks to split for (default: this job's).

    Returns:
        tf.data.Dataset: this rank's micro-batches.

    Raises:
        TypeError: `dataset` is not a `tf.data.Dataset`.
        ValueError: the dataset is not batched, or holds a shuffle without a seed that
            tarantella cannot rebuild.
    """
    if rank is None or size is None:
        comm = world.init()
        rank, size = comm.rank, comm.size
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"tarantella distributes tf.data.Dataset inputs; got {type(dataset).__name__}. "
            "Build one with tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).")
    _check_batched(dataset)
    chain = _rebuildable_chain(dataset)
    base = chain[0]._input_dataset if chain else dataset
    _check_seeds_outside(base)
    batch_index = _global_batch_index(chain)
    global_batch = _static_batch_size(chain, batch_index)
    if global_batch is not None and global_batch < size:
        logger.warning(
            "The global batch size (%d) is smaller than the number of ranks (%d): ranks %d to %d "
            "get no samples and idle. Use a global batch of at least %d.",
            global_batch, size, global_batch, size - 1, size)
    if size == 1:  # only the shuffle seeds change, so one rank sees what N ranks see together
        return _with_seeds(chain, len(chain), dataset)
    why_whole_batch = _why_whole_batches(chain, batch_index)
    if why_whole_batch is None:
        distributed = _own_micro_batches(chain, batch_index, base, rank, size)
        if int(dataset.cardinality()) >= 0:  # one micro-batch per global batch; tells Keras the steps
            distributed = distributed.apply(tf.data.experimental.assert_cardinality(dataset.cardinality()))
    else:
        _info_once("tarantella: each rank builds the whole global batch and keeps its rows, because %s.",
                   why_whole_batch)
        distributed = _with_seeds(chain, len(chain), dataset).map(
            _rows_of_rank(dataset.element_spec, rank, size))
    if dataset.options().deterministic is False:
        options = tf.data.Options()
        options.deterministic = True
        distributed = distributed.with_options(options)
    distributed._tarantella_global_batch_size = global_batch  # global_batch_size() answers for the rank's dataset
    return distributed


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
    """The batch size of the pipeline's last `batch` when it is a constant, else None (for a rank's
    distributed dataset: the global batch it was split from)."""
    if hasattr(dataset, "_tarantella_global_batch_size"):
        return dataset._tarantella_global_batch_size
    chain = _rebuildable_chain(dataset)
    return _static_batch_size(chain, _global_batch_index(chain))


def _static_batch_size(chain, batch_index):
    """The global batch size, if the pipeline's last `batch` has a constant one."""
    if batch_index is None:
        return None
    value = tf.get_static_value(chain[batch_index]._batch_size)
    return None if value is None else int(value)


# What may follow the global batch when each rank batches only its own samples: these keep
# every batch's rows as they are. Anything else (a map, filter, interleave) sees the whole
# global batch in a serial run, so it must see it on every rank too.
_KEEPS_BATCH_ROWS = {"_ShuffleDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset", "_PrefetchDataset",
                     "_OptionsDataset", "CacheDataset"}


def _why_whole_batches(chain, batch_index):
    """Why each rank must build the whole global batch and keep its rows (None: it can batch only its
    own samples, which needs a plain batch of constant size, dense rows, and nothing after it that
    looks at a batch's contents)."""
    if batch_index is None:
        return "the dataset's last batch is missing"
    node = chain[batch_index]
    if type(node).__name__ == "_PaddedBatchDataset":
        return "the dataset's last batch pads its rows"
    if _static_batch_size(chain, batch_index) is None or tf.get_static_value(node._drop_remainder) is None:
        return "the dataset's last batch has no constant size"
    if not all(isinstance(spec, tf.TensorSpec) and spec.shape.rank is not None
               for spec in tf.nest.flatten(node.element_spec)):
        return "the dataset's last batch has rows that are not dense tensors of known rank"
    after = [n for n in chain[batch_index + 1:] if type(n).__name__ not in _KEEPS_BATCH_ROWS]
    if after:
        return (f"a {_name(after[0])} follows batch() and works on whole global batches, as in a serial "
                "run; put per-sample work before batch() to split it across ranks")
    return None


def _own_micro_batches(chain, batch_index, base, rank, size):
    """The pipeline rebuilt so that the rank maps and batches only its own samples."""
    first_split = batch_index
    while first_split > 0 and type(chain[first_split - 1]).__name__ in _MAPS + ("_PrefetchDataset",):
        first_split -= 1
    maps = [node for node in chain[first_split:batch_index] if type(node).__name__ in _MAPS]
    if any(_draws_random_numbers(node._map_func) for node in maps):
        _info_once("tarantella: a map before batch() draws random numbers (or changes a variable); each "
                   "rank runs it only for its own samples, so draws come from per-rank streams and differ "
                   "from a serial run's. For draws that equal serial training, use stateless random ops "
                   "seeded per sample (see 'Random augmentation' in docs/guide.md).")
    per_sample = [_reuse(node._map_func) for node in maps]
    parallel = [_static(node._num_parallel_calls) for node in maps if hasattr(node, "_num_parallel_calls")]
    parallel = tf.data.AUTOTUNE if tf.data.AUTOTUNE in parallel else max(parallel, default=None)
    record_index, read, why_whole = _record_index(chain, first_split, base)
    if record_index is not None:  # each rank reads only its own records' bytes, in a map of its own
        samples = record_index
        per_sample.insert(0, read)
        parallel = parallel or tf.data.AUTOTUNE
    else:
        _explain_work_on_every_rank(chain, first_split, base, why_whole)
        if not per_sample and _sample_bytes(chain[batch_index]) <= _SLICE_WHOLE_BATCH_MAX_SAMPLE_BYTES:
            # Nothing per sample to split: selecting the rank's samples one by one would cost
            # more than batching the global batch and slicing the rank's rows out of it.
            return _with_seeds(chain, len(chain), base).map(_rows_of_rank(chain[-1].element_spec, rank, size))
        samples = _with_seeds(chain, first_split, base)
    micro_batches = _micro_batches_of_rank(samples, per_sample, parallel, chain[batch_index], rank, size)
    for node in chain[batch_index + 1:]:
        micro_batches = _REAPPLY[type(node).__name__](node, micro_batches)
    return micro_batches


# Up to this sample size, a rank with no per-sample work to split batches the whole global batch
# and slices its rows out: selecting its samples one by one costs a few tf.data ops per sample,
# about as much as copying this many bytes (LeNet-5 on 2 ranks: 8.1 against 5.9 ms a step).
_SLICE_WHOLE_BATCH_MAX_SAMPLE_BYTES = 64 << 10


def _sample_bytes(batch_node):
    """Bytes of one sample of the batch's input, or infinity where a shape is not static."""
    total = 0
    for spec in tf.nest.flatten(batch_node._input_dataset.element_spec):
        if not spec.shape.is_fully_defined():
            return float("inf")
        total += spec.shape.num_elements() * spec.dtype.size
    return total


# Transformations whose output depends only on the positions of their input elements.
_POSITION_ONLY = {"_ShuffleDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset", "_PrefetchDataset"}
_RECORD_READERS = {"TFRecordDatasetV2": "TFRecord", "TextLineDatasetV2": "TextLine"}


def _record_index(chain, first_split, base):
    """The samples below the split maps, as (file, offset, length) of each record in the serial
    order, when they are the records of uncompressed TFRecord or text files: a reader over a list
    (or dataset) of files, or an interleave of readers, then only position-only transformations.

    Returns (index, the split map that reads one record, None), or (None, None, why every rank
    reads every record) where this cannot be done (why is None if no file reader is involved)."""
    interleaves = [i for i in range(first_split) if type(chain[i]).__name__ in _INTERLEAVES]
    if interleaves:
        node = chain[interleaves[-1]]
        above = chain[interleaves[-1] + 1:first_split]
        kind, compression = _reader_in(node)
        if kind is None:
            return None, None, (f"the {_name(node)} whose function is not just a TFRecordDataset or "
                                "TextLineDataset of its file name")
        files = _with_seeds(chain, interleaves[-1], base)
        cycle_length, block_length = _static(node._cycle_length), _static(node._block_length)
        parallel = getattr(node, "_num_parallel_calls", None)
        reader = f"{_name(node)} of {kind}Datasets"
        if _may_reorder(node):
            _info_once("tarantella: the %s runs with deterministic=False, which has no serial order to keep; "
                       "every rank reads in its deterministic order.", _name(node))
    elif type(base).__name__ in _RECORD_READERS:
        above = chain[:first_split]
        kind, compression = _RECORD_READERS[type(base).__name__], _constant_string(base._compression_type)
        files = base._filenames  # its shuffles are seeded: _check_seeds_outside saw to that
        # num_parallel_reads lives only in the reader's implementation: a flat_map, or an interleave
        sequential = type(base._impl).__name__ == "_FlatMapDataset"
        cycle_length, block_length = (1, 1) if sequential else (_static(base._impl._cycle_length), 1)
        parallel = None if sequential else cycle_length
        reader = f"{kind}Dataset" + ("" if sequential else " with num_parallel_reads")
    else:
        return None, None, None
    if files.element_spec != tf.TensorSpec([], tf.string):
        return None, None, f"the {reader} of elements that are not single file names"
    if compression != "":
        return None, None, (f"the {reader} of {compression or 'possibly'} compressed files (compressed "
                            "bytes cannot be skipped; each rank still parses and maps only its own records)")
    if not isinstance(cycle_length, int) or cycle_length < 1 or not isinstance(block_length, int):
        return None, None, (f"the {reader} whose cycle length is AUTOTUNE (it depends on the machine); "
                            "give an integer cycle_length or num_parallel_reads")
    moved = [transformation for transformation in above if type(transformation).__name__ not in _POSITION_ONLY]
    if moved:
        return None, None, f"the {reader}, followed by a {_name(moved[0])} before the maps that parse"
    index = files.interleave(_records_of_file(kind), cycle_length=cycle_length, block_length=block_length,
                             num_parallel_calls=parallel, deterministic=True if parallel is not None else None)
    read = _read_record if kind == "TFRecord" else _read_line
    return _with_seeds(above, len(above), index, rebuild_all=True), read, None


def _reader_in(interleave):
    """(kind, compression) if the interleave's function is exactly TFRecordDataset(file) or
    TextLineDataset(file) with a constant compression (any buffer size), else (None, None).

    Compared by the op types and string constants of the traced functions, so a function that
    changes the file name, or transforms the records, does not match."""
    signature = _reader_signature(interleave._map_func.function.graph)
    matches = [reader for reader, reference in _reference_readers().items() if reference == signature]
    return matches[0] if matches else (None, None)


def _constant_string(tensor):
    """A reader's compression type as a str ("" for none), or None if it is not a constant."""
    value = tf.get_static_value(tf.convert_to_tensor("" if tensor is None else tensor, tf.string))
    return None if value is None else value.decode()


def _reader_signature(graph):
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    strings = [bytes(n.attr["value"].tensor.string_val[0]) if n.attr["value"].tensor.string_val else b""
               for n in nodes if n.op == "Const" and n.attr["dtype"].type == tf.string.as_datatype_enum]
    return sorted(n.op for n in nodes), sorted(strings)


_references = {}


def _reference_readers():
    if not _references:
        names = tf.data.Dataset.from_tensors("file")
        for kind, reader in (("TFRecord", tf.data.TFRecordDataset), ("TextLine", tf.data.TextLineDataset)):
            for compression in ("", "GZIP", "ZLIB"):
                interleave = names.interleave(
                    lambda name, reader=reader, compression=compression: reader(name, compression_type=compression))
                _references[kind, compression] = _reader_signature(interleave._map_func.function.graph)
    return _references


def _records_of_file(kind):
    find = _tfrecord_positions if kind == "TFRecord" else _line_positions

    @tf.autograph.experimental.do_not_convert
    def records(path):
        offsets, lengths = tf.numpy_function(find, [path], (tf.int64, tf.int64), stateful=False)
        offsets, lengths = tf.ensure_shape(offsets, [None]), tf.ensure_shape(lengths, [None])
        return tf.data.Dataset.from_tensor_slices((tf.fill(tf.shape(offsets), path), offsets, lengths))

    return records


_positions = {}  # per process: files are scanned once, not every epoch


def _scanned_once(scan):
    def positions(path):
        path = os.fsdecode(path)
        status = os.stat(path)
        key = (scan.__name__, path, status.st_size, status.st_mtime_ns)
        if key not in _positions:
            _positions[key] = scan(path, status.st_size)
        return _positions[key]
    positions.__name__ = scan.__name__
    return positions


@_scanned_once
def _tfrecord_positions(path, end):
    """Offsets and lengths of a TFRecord file's records, from their 12-byte headers only."""
    offsets, lengths, offset = [], [], 0
    with open(path, "rb") as records:
        while offset < end:
            length, = struct.unpack("<Q", os.pread(records.fileno(), 8, offset))
            offsets.append(offset + 12)  # after the length and its checksum
            lengths.append(length)
            offset += 12 + length + 4  # the record and its checksum
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


@_scanned_once
def _line_positions(path, end):
    """Offsets and lengths of a text file's lines (without the newline), scanned for newlines."""
    newlines = []
    with open(path, "rb") as lines:
        for start in range(0, end, 1 << 22):
            chunk = np.frombuffer(os.pread(lines.fileno(), 1 << 22, start), np.uint8)
            newlines.append(np.flatnonzero(chunk == ord("\n")) + start)
    ends = np.concatenate(newlines + [np.zeros(0, np.int64)]).astype(np.int64)
    if end and (not len(ends) or ends[-1] != end - 1):  # a last line without a newline
        ends = np.append(ends, end)
    starts = np.concatenate([[0], ends[:-1] + 1])[:len(ends)].astype(np.int64)  # none in an empty file
    return starts, ends - starts


def _read_bytes(path, offset, length):
    # opened per record: a data set of thousands of files would exhaust file descriptors if kept open
    with open(os.fsdecode(path), "rb") as records:
        return os.pread(records.fileno(), int(length), int(offset))


@tf.autograph.experimental.do_not_convert
def _read_record(path, offset, length):
    return tf.ensure_shape(tf.numpy_function(_read_bytes, [path, offset, length], tf.string, stateful=False), [])


@tf.autograph.experimental.do_not_convert
def _read_line(path, offset, length):
    # TextLineDataset drops every carriage return of a line, not only one before the newline
    return tf.strings.regex_replace(_read_record(path, offset, length), "\r", "")


def _micro_batches_of_rank(samples, per_sample, parallel, batch_node, rank, size):
    """Per global batch, the rank's samples mapped (`per_sample` functions) and batched: exactly one
    micro-batch each.

    The rank keeps, besides its own samples, one marker row per global batch (its first row;
    its last with drop_remainder) that it never maps: a global batch in which the rank owns
    nothing still yields an empty micro-batch, and an incomplete one is dropped as serially."""
    batch_size = int(tf.get_static_value(batch_node._batch_size))
    drop_remainder = bool(tf.get_static_value(batch_node._drop_remainder))
    rows = micro_batch_size(batch_size, rank, size)
    marker = batch_size - 1 if drop_remainder else 0
    kept_per_batch = rows + (0 if marker % size == rank else 1)

    def owned(position, _=None):
        return tf.equal(position % batch_size % size, rank)

    def kept(position, _):
        return tf.logical_or(owned(position), tf.equal(position % batch_size, marker))

    def run(element):
        for function in per_sample:
            element = function(*element) if isinstance(element, tuple) else function(element)
        return element

    kept_samples = samples.enumerate().filter(kept)
    sample_spec = batch_node._input_dataset.element_spec
    if per_sample and not all(spec.shape.is_fully_defined() for spec in tf.nest.flatten(sample_spec)):
        return _micro_batches_in_windows(kept_samples, run, parallel, batch_node, rows, kept_per_batch,
                                         owned, marker)

    @tf.autograph.experimental.do_not_convert
    def mapped_if_owned(position, sample):
        # the marker row becomes zeros of the right shape; the rank drops it after batching
        placeholder = lambda: tf.nest.map_structure(lambda spec: tf.zeros(spec.shape, spec.dtype), sample_spec)
        return position, tf.cond(owned(position), lambda: run(sample), placeholder) if per_sample else sample

    @tf.autograph.experimental.do_not_convert
    def own_rows(positions, batch):
        mine = owned(positions)
        return tf.nest.map_structure(lambda rows_: tf.boolean_mask(rows_, mine), batch)

    batches = kept_samples.map(mapped_if_owned, num_parallel_calls=parallel,
                               deterministic=True if parallel else None).batch(kept_per_batch)
    if drop_remainder:  # a complete global batch has its last row, the marker
        batches = batches.filter(lambda positions, _: tf.reduce_any(tf.equal(positions % batch_size, marker)))
    return batches.map(own_rows)


def _micro_batches_in_windows(kept_samples, run, parallel, batch_node, rows, kept_per_batch, owned, marker):
    """As _micro_batches_of_rank, for samples of shapes not known in advance (no placeholder row can
    stand for the marker): each global batch's rows are mapped and batched in a window of their own."""
    batch_size = int(tf.get_static_value(batch_node._batch_size))
    no_rows = tf.nest.map_structure(_no_rows, batch_node.element_spec)

    def micro_batch(_, window):
        batch = window.filter(owned).map(lambda _, sample: run(sample), num_parallel_calls=parallel,
                                         deterministic=True if parallel else None)
        batch = batch.batch(max(rows, 1)).concatenate(tf.data.Dataset.from_tensors(no_rows)).take(1)
        if tf.get_static_value(batch_node._drop_remainder):  # a complete global batch has its last row
            complete = window.reduce(False, lambda seen, element: tf.logical_or(
                seen, tf.equal(element[0] % batch_size, marker)))
            batch = batch.take(tf.cast(complete, tf.int64))
        return batch

    return kept_samples.group_by_window(lambda position, _: position // batch_size, micro_batch,
                                        window_size=kept_per_batch)


def _no_rows(spec):
    """An empty micro-batch; a dimension the spec leaves open gets size 0."""
    return tf.zeros([0] + [0 if d is None else d for d in spec.shape.as_list()[1:]], spec.dtype)


def _explain_work_on_every_rank(chain, first_split, base, why_whole):
    """One INFO line for per-sample work that every rank does for every sample."""
    unsplit_maps = [i for i in range(first_split) if type(chain[i]).__name__ in _MAPS]
    if unsplit_maps:
        blocker = chain[unsplit_maps[-1] + 1]
        _info_once("tarantella: a map runs on every rank for every sample, because the %s after it, before "
                   "batch(), needs every sample to keep the serial order. Put it before the map to split "
                   "the map across ranks.", _name(blocker))
    if why_whole is None:
        readers = [node for node in _nodes_below(base) if type(node).__name__ in _FILE_READERS + _INTERLEAVES]
        why_whole = f"the {_name(readers[0])} below a transformation tarantella cannot rebuild" if readers else None
    if why_whole:
        _info_once("tarantella: every rank reads every record, to keep the serial sample order, because of %s. "
                   "To read about 1/p of the bytes per rank, see 'File sources' in docs/guide.md.", why_whole)


def _name(node):
    return type(node).__name__.strip("_").replace("Dataset", "").replace("V2", "")


def _nodes_below(dataset):
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) not in seen:
            seen.add(id(node))
            yield node
            pending.extend(node._inputs())


def _draws_random_numbers(function_wrapper):
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


def _may_reorder(node):
    """Whether a transformation may deliver elements out of order (deterministic=False)."""
    if type(node).__name__ == "_ParallelInterleaveDataset":
        # TensorFlow keeps this flag only in the op: read it from the serialized pipeline.
        graph = tf.compat.v1.GraphDef.FromString(node._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
        flags = [n.attr["deterministic"].s for n in graph.node if n.op.startswith("ParallelInterleaveDataset")]
        return b"false" in flags
    return getattr(node, "_deterministic", None) == "false"


def _check_seeds_outside(untouched):
    """Shuffles we cannot rebuild must already be seeded, or ranks would disagree on the order."""
    for node in _nodes_below(untouched):
        if _is_unseeded_shuffle(node):
            raise ValueError(
                "The dataset shuffles without a seed below a transformation tarantella cannot rebuild "
                f"({type(untouched).__name__.strip('_')}). Every rank must shuffle alike: pass a seed, "
                "e.g. dataset.shuffle(buffer_size, seed=42).")
        if _may_reorder(node):
            raise ValueError(
                f"A {_name(node)} transformation runs with deterministic=False, so "
                "ranks could see samples in different orders. Remove deterministic=False.")


def _must_rebuild(node):
    # A parallel interleave is always rebuilt deterministic: cheaper than reading its flag.
    return _is_unseeded_shuffle(node) or type(node).__name__ == "_ParallelInterleaveDataset" or \
        getattr(node, "_deterministic", None) == "false"


def _with_seeds(chain, stop, base, rebuild_all=False):
    """The dataset chain[stop - 1] (or `base`), re-applied from the lowest transformation that must
    change: a shuffle without a seed, or one that may deliver out of order (from `base`, if all)."""
    must_change = [0] if rebuild_all else [index for index in range(stop) if _must_rebuild(chain[index])]
    if not must_change or stop == 0:
        return chain[stop - 1] if stop else base
    rebuilt = base if rebuild_all else chain[must_change[0]]._input_dataset
    for node in chain[must_change[0]:stop]:
        rebuilt = _REAPPLY[type(node).__name__](node, rebuilt)
    return rebuilt


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


def rows_of_rank(batch, rank, size):
    """Rows rank, rank + size, ... of a batch: a TensorFlow tensor (dense or ragged), or an array of
    NumPy, JAX or torch (None stays None)."""
    if batch is None:
        return None
    if not isinstance(batch, (tf.Tensor, tf.RaggedTensor, tf.Variable)):
        return batch[rank::size]
    # A gather, not batch[rank::size]: TensorFlow's CPU kernel for a strided slice copies element
    # by element (LeNet-5's 64 of 128 rows: 300 us against 80 us).
    count = batch.nrows() if isinstance(batch, tf.RaggedTensor) else tf.shape(batch, out_type=tf.int64)[0]
    return tf.gather(batch, tf.range(tf.minimum(tf.cast(rank, count.dtype), count), count, size))  # none past the end


def _rows_of_rank(element_spec, rank, size):
    @tf.autograph.experimental.do_not_convert
    def rows(*args):
        element = args if isinstance(element_spec, tuple) else args[0]
        return tf.nest.map_structure(lambda batch: rows_of_rank(batch, rank, size), element)

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


def _reapply_interleave(node, dataset):
    parallel = getattr(node, "_num_parallel_calls", None)
    return dataset.interleave(_reuse(node._map_func), cycle_length=_static(node._cycle_length),
                              block_length=_static(node._block_length), num_parallel_calls=parallel,
                              deterministic=True if parallel is not None else None)


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
    "_InterleaveDataset": _reapply_interleave,
    "_ParallelInterleaveDataset": _reapply_interleave,
}


# -- user inputs as datasets of global batches ---------------------------------------------

# Transformations that keep elements batched, or unbatched, as their input was.
_KEEPS_BATCHING = set(_REAPPLY) - set(_BATCHES) - set(_INTERLEAVES) | {"_ShardDataset", "_IgnoreErrorsDataset",
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


class EpochOrder(keras.callbacks.Callback):
    """Gives the epochs of a fit resumed from a backup (BackupAndRestore's, or the automatic backups of
    a restarted job) the sample orders they have in an uninterrupted run.

    An input draws each epoch's order anew: a shuffle with reshuffle_each_iteration from a seed
    generator when an iterator is made (or, for some pipelines, at its first read), Keras' adapters
    from NumPy's, Python's or torch's generator. A resumed fit starts at epoch k > its initial epoch,
    so before that epoch the input draws what the k - initial skipped epochs would have drawn: for a
    dataset tarantella split, the iterators an uninterrupted fit would have made, one batch read from
    each that fit read; for an input Keras batches, the same through Keras' own epoch iterator
    (keras_batches.replay_passes). A fit started at a later epoch by its own `initial_epoch` replays
    nothing, as in Keras: its input goes on from where the program left it."""

    def __init__(self, initial_epoch):
        super().__init__()
        self._initial_epoch = initial_epoch
        self._dataset = None
        self._keras_epoch_iterator = None
        self._started = False

    def skip_earlier_passes_of(self, dataset):
        self._dataset = dataset

    def replay_through(self, keras_epoch_iterator):
        self._keras_epoch_iterator = keras_epoch_iterator

    def on_train_begin(self, logs=None):
        self._started = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._started:
            return
        self._started = True
        skipped = epoch - self._initial_epoch
        if skipped <= 0:
            return
        if self._keras_epoch_iterator is not None:
            keras_batches.replay_passes(self._keras_epoch_iterator, skipped)
        elif self._dataset is not None:
            # Checked against Keras in tests/test_keras_internals.py.
            per_epoch = backends.step_class().keras_iterators_per_epoch(int(self._dataset.cardinality()) >= 0)
            for _ in range(skipped):
                next(iter(self._dataset), None)  # the epoch's own iterator
                for _ in range(per_epoch - 1):
                    iter(self._dataset)  # Keras' unused one


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
