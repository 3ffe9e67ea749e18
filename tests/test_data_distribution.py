"""Rank micro-batches together are exactly the global batch, for many pipeline shapes.

Runs in one process: every rank's dataset is built and iterated here.
"""

import numpy as np
import pytest
import tensorflow as tf

from tarantella import data

N = 103


def features():
    return np.arange(N, dtype=np.float32), np.arange(N, dtype=np.int64) % 5


def tensor_slices():
    x, y = features()
    return tf.data.Dataset.from_tensor_slices((x, y))


PIPELINES = {
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


def batches(dataset):
    # a ragged row becomes its text, so rows compare exactly like dense ones
    as_numpy = lambda t: np.array([str(row) for row in t.to_list()]) if isinstance(t, tf.RaggedTensor) else t.numpy()
    return [tf.nest.map_structure(as_numpy, element) for element in dataset]


@pytest.fixture(autouse=True)
def no_global_seed():
    tf.random.set_seed(None)  # so that "unseeded" really means unseeded


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_micro_batches_make_up_the_global_batch(pipeline, ranks):
    reference = batches(data.distribute(PIPELINES[pipeline](), 0, 1))
    shards = [batches(data.distribute(PIPELINES[pipeline](), rank, ranks)) for rank in range(ranks)]
    for rank_batches in shards:
        assert len(rank_batches) == len(reference), "every rank must run the same number of steps"
    for step, global_batch in enumerate(reference):
        leaves = tf.nest.flatten(global_batch)
        rows = len(leaves[0])
        sizes = [len(tf.nest.flatten(shard[step])[0]) for shard in shards]
        assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
        assert sizes == [data.micro_batch_size(rows, rank, ranks) for rank in range(ranks)]
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
            data.micro_batch_size(len(b), rank, ranks) for b in np.array_split(np.arange(N), range(16, N, 16)))


def test_maps_that_draw_random_numbers_run_on_every_sample():
    dataset = tensor_slices().map(lambda x, y: (x + tf.random.uniform([], seed=1), y)).batch(16)
    chain = data._rebuildable_chain(dataset)
    assert data._splittable_maps(chain, data._global_batch_index(chain)) == []


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
