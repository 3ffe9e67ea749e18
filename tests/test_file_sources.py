"""Record files read about 1/p per rank: interleaves of TFRecordDatasets, num_parallel_reads and
TextLineDataset. Rank micro-batches together are exactly the serial global batches, and each rank
reads (by offset) exactly the records it trains on. Compressed files and shapes that cannot be
indexed are read whole by every rank, still split exactly, with one INFO line naming the reason.

Runs in one process: every rank's dataset is built and iterated here. The files and pipelines
are tests/workers/record_files.py's, which tests/workers/backend_inputs.py trains on under Keras'
JAX and torch backends.
"""

import gzip

import numpy as np
import pytest
import tensorflow as tf

from tarantella import data
from tarantella.data import file_records, notes, pipelines

from workers import record_files
from workers.record_files import N, READ_WHOLE, parse_record

FILES = None  # the folder of the files, written once per module


@pytest.fixture(scope="module", autouse=True)
def files(tmp_path_factory):
    global FILES
    FILES = tmp_path_factory.mktemp("records")
    record_files.write(FILES)


# The shared pipelines (tests/workers/record_files.py), each reading FILES when called.
PIPELINES = {name: (lambda build=build: build(FILES)) for name, build in record_files.PIPELINES.items()}
INDEXED = {name: PIPELINES[name] for name in record_files.INDEXED}

# Samples entering batch() per epoch, where it drops an incomplete last batch (whose samples are still read).
STREAM = {"num-parallel-reads": 150}
# Both interleaves share one shape: one runs on 2 ranks, the other on 3, to keep the test fast.
CASES = [("interleave", 2), ("list-files-parallel-interleave", 3)] + \
    [(name, ranks) for name in ("num-parallel-reads", "text-lines") for ranks in (2, 3)] + \
    [(name, 3) for name in READ_WHOLE]


def batches(dataset, epochs):
    return [tf.nest.map_structure(lambda t: t.numpy(), element) for _ in range(epochs) for element in dataset]


@pytest.mark.parametrize("pipeline,ranks", CASES)
def test_ranks_together_yield_the_serial_batches_and_read_only_their_records(pipeline, ranks, monkeypatch):
    epochs = 2 if pipeline == "list-files-parallel-interleave" else 1  # files are reshuffled each epoch
    reference = batches(PIPELINES[pipeline](), epochs)
    read, original = [], file_records._read_bytes

    def read_and_note(path, offset, length):
        read.append((path, int(offset), int(length)))
        return original(path, offset, length)

    monkeypatch.setattr(file_records, "_read_bytes", read_and_note)
    shards, reads = [], []
    for rank in range(ranks):
        read.clear()
        shards.append(batches(data.distribute(PIPELINES[pipeline](), rank, ranks), epochs))
        reads.append(list(read))
    for shard in shards:
        assert len(shard) == len(reference), "every rank must run the same number of steps"
    for step, global_batch in enumerate(reference):
        rows = len(global_batch[1])
        assert [len(shard[step][1]) for shard in shards] == [pipelines.micro_batch_size(rows, r, ranks) for r in range(ranks)]
        for position, leaf in enumerate(global_batch):
            rebuilt = np.empty_like(leaf)
            for rank, shard in enumerate(shards):
                rebuilt[rank::ranks] = shard[step][position]
            np.testing.assert_array_equal(rebuilt, leaf, err_msg=f"{pipeline}, step {step}")
    if pipeline in READ_WHOLE:
        assert not any(reads), "read whole through TensorFlow's reader"
        return
    stream = STREAM.get(pipeline, sum(len(labels) for _, labels in reference) // epochs)
    batch_size = len(reference[0][1])
    for rank in range(ranks):  # one read per own sample, of that record's bytes only
        owned = sum(position % batch_size % ranks == rank for position in range(stream))
        assert len(reads[rank]) == owned * epochs, f"rank {rank}"
    everything = sorted(r for rank_reads in reads for r in rank_reads)
    assert len(set(everything)) == min(stream, N), "no record is read by two ranks in one epoch"
    total = sum(length for _, _, length in everything)
    for rank_reads in reads:  # a rank reads about 1/p of the bytes
        assert sum(length for _, _, length in rank_reads) <= total / ranks + 3 * len(reference)


def test_text_lines_are_read_as_text_line_dataset_reads_them(tmp_path):
    paths = [str(tmp_path / "lines.txt"), str(tmp_path / "empty.txt")]
    (tmp_path / "lines.txt").write_bytes(b"one\r\ntwo\n\nthr\ree\r\r\n\nlast\r")
    (tmp_path / "empty.txt").write_bytes(b"")
    serial = list(tf.data.TextLineDataset(paths).as_numpy_iterator())
    shards = [list(data.distribute(tf.data.TextLineDataset(paths).batch(4), rank, 2).unbatch().as_numpy_iterator())
              for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(serial) and len(serial) == 6


def interleave_of(reader, **options):
    return tf.data.Dataset.from_tensor_slices(record_files.record_files(FILES)).interleave(reader, **options).map(
        parse_record).batch(16)


def test_info_lines_say_why_every_rank_reads_every_record(caplog):
    notes._said.clear()
    with caplog.at_level("INFO", logger="tarantella"):
        data.distribute(PIPELINES["gzip-records"](), 0, 2)
        data.distribute(interleave_of(lambda name: tf.data.TFRecordDataset(name, "ZLIB"), cycle_length=2), 0, 2)
        data.distribute(interleave_of(tf.data.TFRecordDataset, num_parallel_calls=tf.data.AUTOTUNE), 0, 2)
        data.distribute(interleave_of(lambda name: tf.data.TFRecordDataset(name).skip(1), cycle_length=2), 0, 2)
        data.distribute(interleave_of(tf.data.TFRecordDataset, cycle_length=2, num_parallel_calls=2,
                                      deterministic=False), 0, 2)
        data.distribute(PIPELINES["interleave-then-filter"](), 0, 2)
        data.distribute(INDEXED["interleave"](), 0, 2)  # reads 1/p: says nothing
    lines = [record.getMessage() for record in caplog.records if record.name == "tarantella"]
    assert len(lines) == 6, lines
    assert "because of the TFRecordDataset of GZIP compressed files" in lines[0]
    assert "because of the Interleave of TFRecordDatasets of ZLIB compressed files" in lines[1]
    assert "ParallelInterleave of TFRecordDatasets whose cycle length is AUTOTUNE" in lines[2]
    assert "Interleave whose function is not just a TFRecordDataset or TextLineDataset" in lines[3]
    assert "ParallelInterleave runs with deterministic=False, which has no serial order to keep" in lines[4]
    assert "Interleave of TFRecordDatasets, followed by a Filter" in lines[5]
    assert all("'File sources' in docs/guide.md" in line for line in lines[:4] + lines[5:])


def test_gzip_files_exist_as_compressed_bytes():
    """Guards the read-whole cases above: the .gz files really are compressed."""
    with gzip.open(record_files.record_files(FILES, ".gz")[0]) as compressed:
        assert compressed.read() == (FILES / "part0.tfrecord").read_bytes()
