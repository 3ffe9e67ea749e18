"""The record and text files of tests/test_file_sources.py, and the tf.data pipelines that read them.

Shared by tests/test_file_sources.py (each rank's batches against the serial ones, on TensorFlow)
and tests/workers/backend_inputs.py (training on them under tnt.Model on Keras' JAX and torch
backends against serial Keras). Imports TensorFlow only, never tarantella, so that a serial worker
can use it. Every pipeline is a function of the folder that `write(folder)` filled.
"""

import os

import tensorflow as tf

RECORDS_PER_FILE = [40, 7, 0, 56]  # uneven, one empty: interleave cycles refill at different times
N = sum(RECORDS_PER_FILE)


def record_files(folder, suffix=""):
    return [os.path.join(str(folder), f"part{part}.tfrecord{suffix}") for part in range(len(RECORDS_PER_FILE))]


def text_files(folder):
    return [os.path.join(str(folder), f"part{part}.csv") for part in range(2)]


def write(folder):
    """Record i holds the number i as text: plain and GZIP TFRecord files, and two CSV files."""
    first = 0
    for part, count in enumerate(RECORDS_PER_FILE):
        for suffix, options in (("", None), (".gz", "GZIP")):
            with tf.io.TFRecordWriter(record_files(folder, suffix)[part], options) as writer:
                for i in range(first, first + count):
                    writer.write(str(i).encode())
        first += count
    # Windows line ends, a blank-free last line without a newline: read as TextLineDataset reads them
    paths = text_files(folder)
    with open(paths[0], "wb") as csv:
        csv.write(b"".join(b"%d,%d\r\n" % (i, i % 3) for i in range(60)))
    with open(paths[1], "wb") as csv:
        csv.write(b"\n".join(b"%d,%d" % (i, i % 3) for i in range(60, N)))


def parse_record(record):
    value = tf.strings.to_number(record, tf.float32)
    return tf.fill([2], value), tf.cast(value, tf.int64) % 5


def parse_line(line):
    value, label = tf.io.decode_csv(line, [0.0, 0])
    return tf.fill([2], value), label


# Shapes whose records are indexed: each rank reads only its own.
INDEXED = {
    "interleave": lambda folder: tf.data.Dataset.from_tensor_slices(record_files(folder)).interleave(
        tf.data.TFRecordDataset, cycle_length=2, block_length=3).map(parse_record).batch(16),
    "list-files-parallel-interleave": lambda folder: tf.data.Dataset.list_files(
        os.path.join(str(folder), "*.tfrecord"), seed=7).interleave(
        lambda name: tf.data.TFRecordDataset(name, buffer_size=1024), cycle_length=3, num_parallel_calls=2,
        deterministic=True).shuffle(30, seed=2).map(parse_record, num_parallel_calls=2).batch(10),
    "num-parallel-reads": lambda folder: tf.data.TFRecordDataset(record_files(folder), num_parallel_reads=3).repeat(
        2).take(150).map(parse_record).batch(16, drop_remainder=True),
    "text-lines": lambda folder: tf.data.TextLineDataset(text_files(folder)).map(parse_line).batch(12),
}
# Read whole by every rank (the split maps still run only for a rank's own samples).
READ_WHOLE = {
    "gzip-records": lambda folder: tf.data.TFRecordDataset(record_files(folder, ".gz"), compression_type="GZIP").map(
        parse_record).batch(16),
    "interleave-then-filter": lambda folder: tf.data.Dataset.from_tensor_slices(record_files(folder)).interleave(
        tf.data.TFRecordDataset, cycle_length=2).filter(lambda r: tf.strings.length(r) > 1).map(
        parse_record).batch(16),
}
PIPELINES = {**INDEXED, **READ_WHOLE}
