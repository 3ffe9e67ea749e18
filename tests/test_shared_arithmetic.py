"""The arithmetic every backend's step shares (tarantella/backends/moments.py, metric_sums.py,
rows.py), checked in one process on the suite's backend: parts of a batch combined as ranks
combine them give what Keras computes on the whole batch."""

import keras
import numpy as np
import pytest

from tarantella import backends
from tarantella.backends import metric_sums, moments, rows


@pytest.mark.parametrize("ranks", [2, 3, 5])
@pytest.mark.parametrize("mean, rtol", [(10.0, 1e-4), (1000.0, 1e-4)])
def test_moment_sums_of_the_parts_give_the_whole_batch_moments_even_with_an_empty_part(ranks, mean, rtol):
    dtype = backends.step_class().widest_float
    if dtype == "float32" and mean > 100:
        pytest.skip("JAX without x64 forms the moment sums in float32, which cancel where the mean is "
                    "1000 standard deviations (docs/architecture.md)")
    rng = np.random.default_rng(ranks)
    batch = (mean + rng.normal(size=(4, 6, 3))).astype(np.float32)
    parts = [batch[rank::ranks] for rank in range(ranks)]  # 5 ranks: the fifth part is empty
    summed = 0.0
    for part in parts:
        contributes = len(part) > 0
        part = part if contributes else np.zeros((1, 6, 3), np.float32)
        local, shape, axes = moments.local_sums(part, [0, 1], dtype, contributes)
        summed = summed + keras.ops.convert_to_numpy(local)
    summed = keras.ops.convert_to_tensor(summed, dtype)
    mean, variance = moments.global_moments(summed, shape, axes, False, "float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(mean), batch.astype(np.float64).mean((0, 1)), rtol=1e-6)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variance), batch.astype(np.float64).var((0, 1)), rtol=rtol)
    assert tuple(mean.shape) == (3,) and keras.backend.standardize_dtype(mean.dtype) == "float32"


@pytest.mark.parametrize("xp", ["keras", "numpy"])
def test_metric_increments_travel_in_one_vector_and_come_back_in_their_shapes_and_dtypes(xp):
    xp = metric_sums.KERAS_OPS if xp == "keras" else metric_sums.NUMPY
    values = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array(5, np.int32), np.array([0.5], np.float32)]
    vector = metric_sums.flat(values, "float64", weights=[None, None, 2.0], xp=xp)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(vector), [1, 2, 3, 4, 5, 1.0])
    back = metric_sums.pieces(vector * 2, values, xp=xp)
    assert [tuple(piece.shape) for piece in back] == [(2, 2), (), (1,)]
    assert [keras.backend.standardize_dtype(piece.dtype) for piece in back] == ["float32", "int32", "float32"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(back[0]), [[2, 4], [6, 8]])
    assert int(keras.ops.convert_to_numpy(back[1])) == 10


def test_a_batch_without_rows_becomes_one_zero_row_and_a_batch_with_rows_stays():
    x, y = np.ones((0, 4, 2), np.float32), np.ones((0,), np.int32)
    (zero_x, zero_y), samples = rows.at_least_one_row((x, y))
    assert samples == 0
    assert zero_x.shape == (1, 4, 2) and not np.any(keras.ops.convert_to_numpy(zero_x))
    assert keras.backend.standardize_dtype(zero_y.dtype) == "int32" and zero_y.shape == (1,)
    data, samples = rows.at_least_one_row((np.ones((3, 4, 2)), np.ones(3)))
    assert samples == 3 and data[0].shape == (3, 4, 2)


def test_a_rank_without_samples_keeps_its_non_trainable_weights_and_advances_its_seed_generators():
    """The JAX and torch steps of a rank without samples keep BatchNormalization's moving statistics
    (its zero row would move them) but take its seed generators' new states: every rank draws alike."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dropout(0.5)])
    variables = model.non_trainable_variables
    seeds = [i for i, v in enumerate(variables) if "seed_generator" in v.path]
    assert len(seeds) == 1 and len(variables) == 3, [v.path for v in variables]
    before = [keras.ops.convert_to_numpy(v) for v in variables]
    after = [value + 1 for value in before]
    without = rows.non_trainable_after_step(model, 0, before, after)
    for i, value in enumerate(without):
        np.testing.assert_array_equal(value, after[i] if i in seeds else before[i], err_msg=variables[i].path)
    with_samples = rows.non_trainable_after_step(model, 2, before, after)
    assert all(np.array_equal(value, new) for value, new in zip(with_samples, after))
