"""Rank micro-batches together are exactly the global batch, for many pipeline shapes.

Runs in one process: every rank's dataset is built and iterated here.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tarantella import data
from tarantella.data import file_records, notes, pipelines, rebuild

N = 103
FILES = None  # a folder with one PNG per sample and TFRecord files, made once per module


def features():
    return np.arange(N, dtype=np.float32), np.arange(N, dtype=np.int64) % 5


def tensor_slices():
    x, y = features()
    return tf.data.Dataset.from_tensor_slices((x, y))


def png_files():
    return tf.data.Dataset.from_tensor_slices([str(FILES / f"{i}.png") for i in range(N)])


def read_png(path):
    image = tf.io.decode_png(tf.io.read_file(path), channels=1)
    label = tf.strings.to_number(tf.strings.split(tf.strings.split(path, "/")[-1], ".")[0], tf.int64)
    return tf.cast(tf.reshape(image, [2, 2, 1]), tf.float32), label % 5


def record_files():
    return [str(FILES / f"part{i}.tfrecord") for i in range(3)]


def parse_record(record):
    value = tf.strings.to_number(record, tf.float32)
    return tf.fill([2], value), tf.cast(value, tf.int64) % 5


def with_sample_seeds(dataset, seed):
    """The guide's recipe: a per-sample seed pair, new each epoch, the same on every rank."""
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2, drop_remainder=True)
    return tf.data.Dataset.zip(dataset, seeds)


def stateless_augment(sample, seed):
    x, y = sample
    image = tf.image.stateless_random_flip_left_right(tf.fill([2, 2, 1], x), seed)
    return image + tf.random.stateless_uniform([2, 2, 1], seed), y


PIPELINES_1_TO_4_RANKS = {
    "batch": lambda: tensor_slices().batch(16),
    "map-batch": lambda: tensor_slices().map(lambda x, y: (x * 2, y)).batch(16),
    "parallel-map": lambda: tensor_slices().map(lambda x, y: (tf.fill([3], x), y), num_parallel_calls=4).batch(10),
    "filter": lambda: tensor_slices().filter(lambda x, y: y != 3).map(lambda x, y: (x + 1, y)).batch(12),
    "seeded-shuffle": lambda: tensor_slices().shuffle(N, seed=5).batch(16),
    "unseeded-shuffle": lambda: tensor_slices().shuffle(N).map(lambda x, y: (-x, y)).batch(16),
    "repeat-take": lambda: tensor_slices().repeat(3).take(250).batch(32),
    "take-skip": lambda: tensor_slices().skip(7).take(60).batch(9),
    "cache-prefetch": lambda: tensor_slices().map(lambda x, y: (x, y)).cache().batch(16).prefetch(2),
    "drop-remainder": lambda: tensor_slices().batch(16, drop_remainder=True),
    "batch-then-map": lambda: tensor_slices().batch(16).map(lambda x, y: (x / 2, y)),
    "batch-repeat": lambda: tensor_slices().batch(25).repeat(2),
    "padded-batch": lambda: tf.data.Dataset.range(N).map(lambda i: tf.fill([i % 4], i)).padded_batch(8),
    "tuple-x": lambda: tf.data.Dataset.from_tensor_slices(((features()[0], features()[0] * 3), features()[1])).batch(11),
    "dict-x": lambda: tf.data.Dataset.from_tensor_slices(
        ({"a": features()[0], "b": np.ones((N, 2), np.float32)}, features()[1])).map(
        lambda d, y: ({"a": d["a"] + 1, "b": d["b"]}, y)).batch(13),
    "sample-weights": lambda: tf.data.Dataset.from_tensor_slices((*features(), np.ones(N, np.float32))).batch(20),
    "batch-smaller-than-ranks": lambda: tensor_slices().batch(2),
    "ragged": lambda: tf.data.Dataset.range(N).map(lambda i: tf.range(i % 5)).ragged_batch(8),
}
# Python maps, random maps, files and filters: checked on 3 ranks only (uneven splits), to keep the
# test fast; those that stress empty micro-batches also on 4.
PIPELINES_3_RANKS = {
    "python-map": lambda: tensor_slices().map(
        lambda x, y: (tf.ensure_shape(tf.numpy_function(lambda v: v * 3, [x], tf.float32), []), y)).batch(14),
    "python-map-unknown-shape": lambda: tensor_slices().map(
        lambda x, y: (tf.numpy_function(lambda v: v * 3, [x], tf.float32), y)).batch(14),
    "map-then-filter": lambda: tensor_slices().map(lambda x, y: (x * 2, y)).filter(
        lambda x, label: label > 1).batch(10),
    "filter-map-drop-remainder": lambda: tensor_slices().filter(lambda x, y: y != 0).map(
        lambda x, y: (x - 1, y)).batch(7, drop_remainder=True),
    "tiny-drop-remainder": lambda: tensor_slices().map(lambda x, y: (x, y)).batch(3, drop_remainder=True),
    "prefetch-before-batch": lambda: tensor_slices().map(lambda x, y: (x + 3, y)).prefetch(4).batch(16),
    "stateless-random-map": lambda: with_sample_seeds(tensor_slices(), 3).shuffle(N, seed=1).map(
        stateless_augment, num_parallel_calls=2).batch(12),
    "png-files": lambda: png_files().shuffle(N).map(read_png, num_parallel_calls=3).batch(10),
    "tfrecord": lambda: tf.data.TFRecordDataset(record_files()).map(parse_record).batch(16),
    "shuffled-records": lambda: tf.data.TFRecordDataset(record_files()).shuffle(N).map(parse_record).batch(16),
    "interleaved-records": lambda: tf.data.Dataset.from_tensor_slices(record_files()).interleave(
        tf.data.TFRecordDataset, cycle_length=2, num_parallel_calls=2, deterministic=False).map(
        parse_record).batch(16),
}

# Transformations after the global batch: a serial run applies them to whole global batches, and so
# must every rank (a map traced for the batch of 16 once met micro-batches of 8). Each with and
# without drop_remainder (a static batch dimension), on 2 and 3 ranks.
AFTER_BATCH = {
    "map": lambda batches: batches.map(lambda x, y: (tf.reshape(x, [-1, 1]) / 2, y)),
    "map-sees-whole-batch": lambda batches: batches.map(lambda x, y: (x - tf.reduce_mean(x), y)),
    "parallel-map": lambda batches: batches.map(lambda x, y: (x * 3, y), num_parallel_calls=2),
    "interleave": lambda batches: batches.interleave(lambda x, y: tf.data.Dataset.from_tensors((x, y)),
                                                     cycle_length=2),
    "filter": lambda batches: batches.filter(lambda x, y: tf.reduce_sum(y) % 3 != 0),
    "unbatch-batch": lambda batches: batches.unbatch().batch(12),
    "rebatch": lambda batches: batches.rebatch(8),
    "prefetch": lambda batches: batches.prefetch(2),
    "padded-batch-map": lambda _: tf.data.Dataset.range(N).map(lambda i: tf.fill([i % 4], i)).padded_batch(
        8, padded_shapes=[4], drop_remainder=True).map(lambda row: tf.reverse(row, [1])),
}
PIPELINES_AFTER_BATCH = {f"batch-{name}{suffix}": (lambda make=make, drop=drop: make(
    tensor_slices().batch(16, drop_remainder=drop)))
    for name, make in AFTER_BATCH.items() for suffix, drop in (("-drop-remainder", True), ("", False))}


def batches(dataset):
    # a ragged row becomes its text, so rows compare exactly like dense ones
    as_numpy = lambda t: np.array([str(row) for row in t.to_list()]) if isinstance(t, tf.RaggedTensor) else t.numpy()
    return [tf.nest.map_structure(as_numpy, element) for element in dataset]


@pytest.fixture(scope="module", autouse=True)
def files(tmp_path_factory):
    global FILES
    FILES = tmp_path_factory.mktemp("samples")
    for i in range(N):
        (FILES / f"{i}.png").write_bytes(tf.io.encode_png(tf.fill([2, 2, 1], tf.constant(i, tf.uint8))).numpy())
    for part, indices in enumerate(np.array_split(np.arange(N), 3)):
        with tf.io.TFRecordWriter(str(FILES / f"part{part}.tfrecord")) as writer:
            for i in indices:
                writer.write(str(i).encode())


@pytest.fixture(autouse=True)
def no_global_seed():
    tf.random.set_seed(None)  # so that "unseeded" really means unseeded


PIPELINES = {**PIPELINES_1_TO_4_RANKS, **PIPELINES_3_RANKS, **PIPELINES_AFTER_BATCH}
CASES = [(name, ranks) for name in sorted(PIPELINES_1_TO_4_RANKS) for ranks in (1, 2, 3, 4)] + \
    [(name, 3) for name in sorted(PIPELINES_3_RANKS)] + [("tiny-drop-remainder", 4), ("tfrecord", 4)] + \
    [(name, ranks) for name in sorted(PIPELINES_AFTER_BATCH) for ranks in (2, 3)]


# Pipelines whose order is random where nothing seeds them (an unseeded shuffle without a global
# seed, a parallel interleave with deterministic=False): no two runs agree, so their reference is
# tarantella's one order for every rank; every other pipeline is compared with itself, untouched.
RANDOM_UNTOUCHED = {"unseeded-shuffle", "png-files", "shuffled-records", "interleaved-records"}


@pytest.mark.parametrize("pipeline,ranks", CASES)
def test_micro_batches_make_up_the_global_batch(pipeline, ranks):
    untouched = PIPELINES[pipeline]()
    reference = batches(data.distribute(untouched, 0, 1) if pipeline in RANDOM_UNTOUCHED else untouched)
    shards = [batches(data.distribute(PIPELINES[pipeline](), rank, ranks)) for rank in range(ranks)]
    for rank_batches in shards:
        assert len(rank_batches) == len(reference), "every rank must run the same number of steps"
    for step, global_batch in enumerate(reference):
        leaves = tf.nest.flatten(global_batch)
        rows = len(leaves[0])
        sizes = [len(tf.nest.flatten(shard[step])[0]) for shard in shards]
        assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
        assert sizes == [pipelines.micro_batch_size(rows, rank, ranks) for rank in range(ranks)]
        for position, leaf in enumerate(leaves):
            rebuilt = np.empty_like(leaf)
            for rank, shard in enumerate(shards):
                rebuilt[rank::ranks] = tf.nest.flatten(shard[step])[position]
            np.testing.assert_array_equal(rebuilt, leaf, err_msg=f"{pipeline}, step {step}")


def test_an_unseeded_shuffle_gets_seed_42_and_a_user_seed_is_kept():
    distributed = batches(data.distribute(tensor_slices().shuffle(N).batch(16), 0, 1))
    seeded_42 = batches(tensor_slices().shuffle(N, seed=42).batch(16))
    user_seed = batches(data.distribute(tensor_slices().shuffle(N, seed=7).batch(16), 0, 1))
    seeded_7 = batches(tensor_slices().shuffle(N, seed=7).batch(16))
    np.testing.assert_array_equal(np.concatenate([b[0] for b in distributed]),
                                  np.concatenate([b[0] for b in seeded_42]))
    np.testing.assert_array_equal(np.concatenate([b[0] for b in user_seed]),
                                  np.concatenate([b[0] for b in seeded_7]))
    assert not np.array_equal(distributed[0][0], seeded_7[0][0])


def test_a_map_before_batch_runs_only_for_the_ranks_own_samples(tmp_path):
    calls = tmp_path / "calls.txt"

    def pipeline():
        # tf.print appends one line per sample the map really processes
        def expensive(x, y):
            printed = tf.print(x, output_stream=f"file://{calls}")
            with tf.control_dependencies([printed]):
                return x * 10, y
        return tensor_slices().map(expensive).batch(16)

    ranks = 4
    for rank in range(ranks):
        calls.write_text("")
        shard = batches(data.distribute(pipeline(), rank, ranks))
        processed = len(calls.read_text().splitlines())
        assert processed == sum(len(b[0]) for b in shard) == sum(
            pipelines.micro_batch_size(len(b), rank, ranks) for b in np.array_split(np.arange(N), range(16, N, 16)))


def counted(function):
    """`function` as a map that also counts its calls in CALLS, in Python, where TF cannot elide it."""
    def count(x):
        CALLS.append(1)
        return x

    def map_with_count(x, y):
        x = tf.ensure_shape(tf.numpy_function(count, [x], tf.float32), [])
        return function(x, y)
    return map_with_count


CALLS = []
FLIP = keras.layers.RandomFlip(seed=3)
COUNTED_MAPS = {
    "pure": lambda x, y: (x * 10, y),
    "random": lambda x, y: (x + tf.random.uniform([]), y),
    "keras-random-layer": lambda x, y: (FLIP(tf.fill([4, 4, 1], x)), y),
    "stateless-random": lambda x, y: (tf.random.stateless_uniform([], [1, tf.cast(x, tf.int64)]), y),
}


@pytest.mark.parametrize("kind", sorted(COUNTED_MAPS))
def test_each_rank_maps_and_batches_only_its_own_samples(kind):
    ranks, batch = 4, 14
    owned = [sum(pipelines.micro_batch_size(len(b), rank, ranks) for b in np.array_split(np.arange(N), range(batch, N, batch)))
             for rank in range(ranks)]
    for rank in range(ranks):
        CALLS.clear()
        pipeline = tensor_slices().shuffle(N).map(counted(COUNTED_MAPS[kind]), num_parallel_calls=2).batch(batch)
        distributed = data.distribute(pipeline, rank, ranks)
        shard = batches(distributed)
        assert len(CALLS) == owned[rank] == sum(len(b[1]) for b in shard), f"rank {rank}"
        # the rank batches its own rows and one marker row, never the global batch
        batch_sizes = [int(node._batch_size) for node in rebuild.nodes_below(distributed)
                       if type(node).__name__ in rebuild.BATCHES]
        assert batch_sizes == [pipelines.micro_batch_size(batch, rank, ranks) + (rank != 0)]


def test_files_are_read_only_by_the_rank_that_trains_on_them():
    ranks, read = 2, []

    def read_and_note(path):
        read.append(tf.compat.as_str(path))
        return path

    def pipeline():
        paths = png_files().map(lambda p: tf.ensure_shape(tf.numpy_function(read_and_note, [p], tf.string), []))
        return paths.map(read_png).batch(10)

    per_rank = []
    for rank in range(ranks):
        read.clear()
        shard = batches(data.distribute(pipeline(), rank, ranks))
        per_rank.append(sorted(read))
        assert len(read) == sum(len(labels) for _, labels in shard)
    assert sorted(per_rank[0] + per_rank[1]) == sorted(str(FILES / f"{i}.png") for i in range(N))
    assert not set(per_rank[0]) & set(per_rank[1])


def test_a_rank_reads_only_its_own_records_of_a_tfrecord_dataset(monkeypatch):
    ranks, read = 2, []
    original = file_records._read_bytes

    def read_and_note(path, offset, length):
        read.append((tf.compat.as_str(path), int(offset)))
        return original(path, offset, length)

    monkeypatch.setattr(file_records, "_read_bytes", read_and_note)
    per_rank = []
    for rank in range(ranks):
        read.clear()
        shard = batches(data.distribute(PIPELINES["shuffled-records"](), rank, ranks))
        assert len(read) == sum(len(labels) for _, labels in shard)
        per_rank.append(set(read))
    assert len(per_rank[0] | per_rank[1]) == N and not per_rank[0] & per_rank[1]


def test_info_lines_name_what_every_rank_does_in_full(caplog):
    notes._said.clear()
    with caplog.at_level("INFO", logger="tarantella"):
        data.distribute(PIPELINES["map-then-filter"](), 0, 2)
        data.distribute(tensor_slices().map(COUNTED_MAPS["random"]).batch(8), 0, 2)
        data.distribute(PIPELINES["interleaved-records"](), 0, 2)  # reads 1/p, but has no serial order
        data.distribute(PIPELINES["stateless-random-map"](), 0, 2)  # splits exactly: says nothing
        data.distribute(PIPELINES["shuffled-records"](), 0, 2)  # reads only its own records: says nothing
    said = lambda: [record.getMessage() for record in caplog.records if record.name == "tarantella"]
    lines = said()
    assert len(lines) == 3, lines
    assert "map runs on every rank for every sample, because the Filter after it" in lines[0]
    assert "draws random numbers" in lines[1] and "per-rank streams" in lines[1]
    assert "ParallelInterleave runs with deterministic=False, which has no serial order to keep" in lines[2]
    data.distribute(PIPELINES["map-then-filter"](), 1, 2)
    assert said() == lines, "each line is said once per process"


def test_a_parallel_interleave_with_deterministic_false_is_rebuilt_deterministic():
    distributed = data.distribute(PIPELINES["interleaved-records"](), 1, 2)
    interleaves = [node for node in rebuild.nodes_below(distributed) if type(node).__name__ in rebuild.INTERLEAVES]
    assert interleaves and not any(rebuild.may_reorder(node) for node in interleaves)


def test_a_parallel_interleave_with_deterministic_false_that_cannot_be_rebuilt_is_refused():
    interleaved = PIPELINES["interleaved-records"]().unbatch()
    zipped = tf.data.Dataset.zip((interleaved, tensor_slices())).batch(8)
    with pytest.raises(ValueError, match=r"ParallelInterleave.*deterministic=False"):
        data.distribute(zipped, 0, 2)


def test_tensorflow_still_has_the_private_attributes_tarantella_reads():
    """data.py reads these TF internals to rebuild pipelines; this fails first if TF renames one."""
    source = tensor_slices()
    expected = {
        source.map(lambda x, y: (x, y)): ["_input_dataset", "_map_func"],
        source.map(lambda x, y: (x, y), num_parallel_calls=2, deterministic=False):
            ["_input_dataset", "_map_func", "_num_parallel_calls", "_deterministic"],
        source.filter(lambda x, y: True): ["_input_dataset", "_predicate"],
        source.shuffle(4, seed=1): ["_input_dataset", "_seed", "_seed2", "_buffer_size", "_reshuffle_each_iteration"],
        source.batch(4): ["_input_dataset", "_batch_size", "_drop_remainder"],
        source.batch(4, num_parallel_calls=2): ["_input_dataset", "_batch_size", "_drop_remainder",
                                                "_num_parallel_calls", "_deterministic"],
        source.padded_batch(4): ["_input_dataset", "_batch_size", "_padded_shapes", "_padding_values",
                                 "_drop_remainder"],
        source.repeat(2): ["_input_dataset", "_count"], source.take(2): ["_input_dataset", "_count"],
        source.skip(2): ["_input_dataset", "_count"], source.cache(): ["_input_dataset", "_filename"],
        source.prefetch(2): ["_input_dataset", "_buffer_size"],
        PIPELINES["interleaved-records"]()._input_dataset._input_dataset:
            ["_input_dataset", "_map_func", "_cycle_length", "_block_length", "_num_parallel_calls"],
    }
    for dataset, attributes in expected.items():
        assert type(dataset).__name__ in rebuild.REAPPLY, type(dataset).__name__
        for attribute in attributes:
            assert hasattr(dataset, attribute), f"{type(dataset).__name__}.{attribute}"
    records = tf.data.TFRecordDataset(record_files())
    assert type(records).__name__ == "TFRecordDatasetV2" and type(records._filenames).__name__ == "_TensorSliceDataset"
    assert records._compression_type is None and type(records._impl).__name__ == "_FlatMapDataset"
    parallel_reads = tf.data.TextLineDataset(record_files(), num_parallel_reads=2)
    assert type(parallel_reads).__name__ == "TextLineDatasetV2" and parallel_reads._compression_type is None
    assert int(parallel_reads._impl._cycle_length) == 2 and type(parallel_reads._filenames).__name__ == "_TensorSliceDataset"
    # interleave functions are recognised as readers by their traced ops (file_records._reader_in)
    files = tf.data.Dataset.from_tensor_slices(record_files())
    assert file_records._reader_in(files.interleave(tf.data.TFRecordDataset)) == ("TFRecord", "")
    assert file_records._reader_in(files.interleave(lambda f: tf.data.TextLineDataset(f, "GZIP", 1024))) == ("TextLine", "GZIP")
    assert file_records._reader_in(files.interleave(lambda f: tf.data.TFRecordDataset(f).take(3))) == (None, None)
    assert file_records._reader_in(files.interleave(lambda f: tf.data.TFRecordDataset(f + ".gz"))) == (None, None)
    map_func = source.map(lambda x, y: (x, y))._map_func
    assert hasattr(map_func, "_input_structure") and hasattr(map_func, "output_structure")
    assert rebuild.may_reorder(PIPELINES["interleaved-records"]()._input_dataset._input_dataset)
    assert not rebuild.may_reorder(tf.data.Dataset.range(3).interleave(
        tf.data.Dataset.from_tensors, cycle_length=2, num_parallel_calls=2))
    assert rebuild.draws_random_numbers(source.map(COUNTED_MAPS["keras-random-layer"])._map_func)
    assert not rebuild.draws_random_numbers(source.map(COUNTED_MAPS["stateless-random"])._map_func)


def test_unbatched_dataset_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"not batched.*dataset.batch"):
        data.distribute(tensor_slices(), 0, 2)


def test_non_dataset_input_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"tf.data.Dataset.*from_tensor_slices"):
        data.distribute(np.zeros((4, 2)), 0, 2)


def test_unseeded_shuffle_that_cannot_be_rebuilt_is_refused():
    shuffled = tensor_slices().shuffle(N)
    zipped = tf.data.Dataset.zip((shuffled, tensor_slices())).batch(8)
    with pytest.raises(ValueError, match=r"shuffle\(buffer_size, seed=42\)"):
        data.distribute(zipped, 0, 2)


def test_a_ranks_dataset_tells_the_global_batch_size_it_was_split_from():
    # model.py reads it from the rank's dataset (the BatchNormalization warning)
    assert pipelines.global_batch_size(data.distribute(tensor_slices().map(lambda x, y: (x, y)).batch(16), 1, 2)) == 16
    assert pipelines.global_batch_size(data.distribute(PIPELINES["padded-batch"](), 1, 3)) == 8
