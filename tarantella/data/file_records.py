"""Reading only a rank's own records of TFRecord and text-line files: the pipeline's reader is
replaced by an index of each file's record positions, so that a rank reads the bytes of the
samples it owns and no others."""

import os
import struct

import numpy as np
import tensorflow as tf

from tarantella.data.notes import info_once
from tarantella.data.rebuild import INTERLEAVES, may_reorder, node_name, static_value, with_seeds

_references = {}
_positions = {}  # per process: files are scanned once, not every epoch
# Transformations whose output depends only on the positions of their input elements.
_POSITION_ONLY = {"_ShuffleDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset", "_PrefetchDataset"}


_RECORD_READERS = {"TFRecordDatasetV2": "TFRecord", "TextLineDatasetV2": "TextLine"}


def record_index(chain, first_split, base):
    """The samples below the split maps, as (file, offset, length) of each record in the serial
    order, when they are the records of uncompressed TFRecord or text files: a reader over a list
    (or dataset) of files, or an interleave of readers, then only position-only transformations.

    Returns (index, the split map that reads one record, None), or (None, None, why every rank
    reads every record) where this cannot be done (why is None if no file reader is involved)."""
    interleaves = [i for i in range(first_split) if type(chain[i]).__name__ in INTERLEAVES]
    if interleaves:
        node = chain[interleaves[-1]]
        above = chain[interleaves[-1] + 1:first_split]
        kind, compression = _reader_in(node)
        if kind is None:
            return None, None, (f"the {node_name(node)} whose function is not just a TFRecordDataset or "
                                "TextLineDataset of its file name")
        files = with_seeds(chain, interleaves[-1], base)
        cycle_length, block_length = static_value(node._cycle_length), static_value(node._block_length)
        parallel = getattr(node, "_num_parallel_calls", None)
        reader = f"{node_name(node)} of {kind}Datasets"
        if may_reorder(node):
            info_once("tarantella: the %s runs with deterministic=False, which has no serial order to keep; "
                       "every rank reads in its deterministic order.", node_name(node))
    elif type(base).__name__ in _RECORD_READERS:
        above = chain[:first_split]
        kind, compression = _RECORD_READERS[type(base).__name__], _constant_string(base._compression_type)
        files = base._filenames  # its shuffles are seeded: check_seeds_outside saw to that
        # num_parallel_reads lives only in the reader's implementation: a flat_map, or an interleave
        sequential = type(base._impl).__name__ == "_FlatMapDataset"
        cycle_length, block_length = (1, 1) if sequential else (static_value(base._impl._cycle_length), 1)
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
        return None, None, f"the {reader}, followed by a {node_name(moved[0])} before the maps that parse"
    index = files.interleave(_records_of_file(kind), cycle_length=cycle_length, block_length=block_length,
                             num_parallel_calls=parallel, deterministic=True if parallel is not None else None)
    read = _read_record if kind == "TFRecord" else _read_line
    return with_seeds(above, len(above), index, rebuild_all=True), read, None


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
