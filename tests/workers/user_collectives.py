"""The public collectives against NumPy, and custom training loops against serial Keras.

Every rank builds every rank's inputs (they depend only on the rank and the case), so it
can compute the expected results with NumPy. Prints one summary line per rank and check.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tarantella as tnt  # noqa: E402

RANK, SIZE = tnt.get_rank(), tnt.get_size()
FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
INTEGERS = [np.int64, np.uint8]
SHAPES = [(), (0,), (5,), (2, 3), (0, 3), (3, 0)]
KINDS = ["numpy", "tensor", "variable", "keras-variable"]


def value_of(rank, case, shape, dtype):
    """Rank `rank`'s input of one case: small integers, exact in every dtype, sums included."""
    numbers = np.random.default_rng([rank, case]).integers(0 if dtype in (np.uint8, np.bool_) else -4, 5,
                                                           size=shape)
    return numbers.astype(dtype) if dtype is not np.bool_ else numbers > 2


def as_kind(array, kind):
    if kind == "numpy":
        return array
    if kind == "tensor":
        return tf.constant(array)
    if kind == "variable":
        return tf.Variable(array)
    return keras.Variable(array, dtype=str(array.dtype)) if array.dtype != np.bool_ else tf.Variable(array)


def check(result, expected, what, tolerance=0.0):
    result_array = result.numpy() if isinstance(result, tf.Tensor) else result
    assert isinstance(result, np.ndarray) or isinstance(result, tf.Tensor), (what, type(result))
    assert result_array.dtype == expected.dtype, (what, result_array.dtype, expected.dtype)
    assert result_array.shape == expected.shape, (what, result_array.shape, expected.shape)
    comparable = (lambda a: a) if expected.dtype.kind in "bc" else (lambda a: a.astype(np.float64))
    np.testing.assert_allclose(comparable(result_array), comparable(expected), rtol=tolerance, atol=tolerance,
                               err_msg=what)


def reduced(arrays, op, dtype):
    wide = np.stack([a.astype(np.float64 if np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16
                              else dtype) for a in arrays])
    result = {"sum": np.sum, "mean": np.mean, "prod": np.prod, "min": np.min, "max": np.max}[op](wide, axis=0)
    return result.astype(dtype)


def ops_for(dtype):
    if dtype is np.bool_:
        return []
    if dtype is np.complex64:
        return ["sum", "prod", "mean"]
    return ["sum", "max", "min", "prod"] + (["mean"] if dtype in FLOATS else [])


def collectives_on(values, rows, ops):
    """Every collective on every value; the same calls on every rank."""
    results = []
    for value, row in zip(values, rows):
        results += [tnt.allreduce(value, op=op) for op in ops]
        results += [tnt.broadcast(value, root=root) for root in sorted({0, SIZE - 1})]
        results.append(tnt.allgather(row))
    return results


def expected_results(everyone, everyone_rows, ops):
    expected = []
    for inputs, rows in zip(everyone, everyone_rows):
        expected += [reduced(inputs, op, inputs[0].dtype.type) for op in ops]
        expected += [inputs[root] for root in sorted({0, SIZE - 1})]
        expected.append(np.concatenate([r if r.ndim else r.reshape(1) for r in rows]))
    return expected


def check_collectives():
    """Each dtype in one eager pass per kind of input, and in one tf.function (one trace)."""
    checks = 0
    for case, dtype in enumerate(FLOATS + INTEGERS + [np.complex64, np.bool_]):
        everyone = [[value_of(rank, (case, i), shape, dtype) for rank in range(SIZE)]
                    for i, shape in enumerate(SHAPES)]
        # Rank r gathers r % 3 rows: 0 rows on some rank from 1 rank on; scalars give one row each.
        everyone_rows = [[value_of(rank, (case, i, 1), (rank % 3,) + shape[1:] if shape else (), dtype)
                          for rank in range(SIZE)] for i, shape in enumerate(SHAPES)]
        expected = expected_results(everyone, everyone_rows, ops_for(dtype))
        tolerance = 1e-2 if dtype in (np.float16, ml_dtypes.bfloat16) else 1e-6
        # Every kind of input for two dtypes; NumPy and tf.function for all.
        for kind in (KINDS if dtype in (np.float32, ml_dtypes.bfloat16) else ["numpy"]) + ["function"]:
            values = [as_kind(inputs[RANK], "tensor" if kind == "function" else kind) for inputs in everyone]
            rows = [as_kind(r[RANK], "tensor" if kind == "function" else kind) for r in everyone_rows]
            if kind == "function":
                results = tf.function(lambda v, r: collectives_on(v, r, ops_for(dtype)))(values, rows)
            else:
                results = collectives_on(values, rows, ops_for(dtype))
            for number, (result, wanted) in enumerate(zip(results, expected)):
                check(result, wanted, f"{kind} {np.dtype(dtype).name} result #{number}", tolerance)
                assert isinstance(result, np.ndarray) == (kind == "numpy"), (kind, type(result))
                checks += 1
    tnt.barrier()
    tf.function(tnt.barrier)()
    return checks


def check_structures_and_classes():
    mine = {"w": np.full((2, 2), RANK + 1.0, np.float32), "none": None, "b": [tf.constant([RANK, 1])]}
    total = tnt.allreduce(mine)
    ranks_sum = SIZE * (SIZE + 1) / 2
    np.testing.assert_array_equal(total["w"], np.full((2, 2), ranks_sum, np.float32))
    assert total["none"] is None
    np.testing.assert_array_equal(total["b"][0].numpy(), [SIZE * (SIZE - 1) // 2, SIZE])

    allreducer = tnt.TensorAllreducer([np.zeros(3), tf.zeros(2)], reduction_op=tnt.ReductionOp.AVERAGE)
    average = allreducer.allreduce([np.full(3, float(RANK)), tf.fill([2], float(RANK))])
    np.testing.assert_allclose(average[0], np.full(3, (SIZE - 1) / 2))
    np.testing.assert_allclose(average[1].numpy(), np.full(2, (SIZE - 1) / 2))

    broadcaster = tnt.TensorBroadcaster({"a": np.zeros((2,), np.int64)}, root_rank=SIZE - 1)
    received = broadcaster.broadcast({"a": np.array([7, SIZE], np.int64)} if RANK == SIZE - 1 else None)
    np.testing.assert_array_equal(received["a"], [7, SIZE])

    # A Keras metric's summed state gives the serial result (docs/guide.md, custom training loops).
    mean = keras.metrics.Mean()
    mean.update_state(np.arange(RANK + 1, dtype=np.float32))
    for variable, total in zip(mean.variables, tnt.allreduce(mean.variables)):
        variable.assign(total)
    everything = np.concatenate([np.arange(rank + 1) for rank in range(SIZE)])
    np.testing.assert_allclose(float(mean.result()), everything.mean(), rtol=1e-6)

    weights = [tf.Variable(np.full((3,), RANK, np.float32)), keras.Variable(np.full((), RANK + 10, np.int64))]
    tnt.broadcast_variables(weights, root=SIZE - 1)
    np.testing.assert_array_equal(weights[0].numpy(), np.full(3, SIZE - 1))
    assert int(weights[1].numpy()) == SIZE + 9


def check_the_original_classes_results():
    """The original Tarantella's classes return a number for a number, an empty structure for an
    empty one, and TensorAllgatherer every rank's values flattened, concatenated in rank order."""
    ranks_sum = SIZE * (SIZE - 1) / 2
    total = tnt.TensorAllreducer(3.0).allreduce(float(RANK))
    assert isinstance(total, float) and total == ranks_sum, (type(total), total)
    count = tnt.TensorAllreducer(1).allreduce(1)
    assert isinstance(count, (int, np.integer)) and not isinstance(count, np.ndarray) and count == SIZE, count
    single = tnt.TensorAllreducer(np.float32(0), reduction_op=tnt.ReductionOp.MAX).allreduce(np.float32(RANK))
    assert type(single) is np.float32 and single == SIZE - 1, (type(single), single)
    assert tnt.TensorAllreducer([]).allreduce([]) == []
    assert tnt.TensorAllreducer({}).allreduce({}) == {}
    mixed = tnt.TensorAllreducer({"count": 0.0, "sums": [np.zeros(2)]}).allreduce(
        {"count": 1.0, "sums": [np.full(2, float(RANK))]})
    assert isinstance(mixed["count"], float) and mixed["count"] == SIZE, mixed
    np.testing.assert_array_equal(mixed["sums"][0], np.full(2, ranks_sum))

    sent = tnt.TensorBroadcaster(0.0, root_rank=SIZE - 1).broadcast(7.5 if RANK == SIZE - 1 else None)
    assert isinstance(sent, float) and sent == 7.5, (type(sent), sent)

    rows = tnt.TensorAllgatherer(np.zeros((1, 2), np.float32)).allgather(np.full((RANK + 1, 2), RANK, np.float32))
    expected = np.concatenate([np.full(2 * (rank + 1), rank, np.float32) for rank in range(SIZE)])
    assert isinstance(rows, np.ndarray) and rows.shape == expected.shape, rows.shape
    np.testing.assert_array_equal(rows, expected)
    per_rank = tnt.TensorAllgatherer(0.0).allgather(float(RANK))
    np.testing.assert_array_equal(per_rank, np.arange(SIZE, dtype=np.float64))
    tensor_rows = tnt.TensorAllgatherer(tf.zeros((2, 3))).allgather(tf.fill((2, 3), float(RANK)))
    np.testing.assert_array_equal(tensor_rows.numpy(), np.repeat(np.arange(SIZE, dtype=np.float32), 6))
    traced = tf.function(lambda t: tnt.TensorAllgatherer(tf.zeros((2, 3))).allgather(t))(tf.fill((2, 3), 1.0))
    assert traced.shape == (6 * SIZE,), traced.shape


def expect_error(call, error_type, *fragments):
    try:
        call()
    except error_type as error:
        message = str(error)
        assert all(fragment in message for fragment in fragments), message
        return
    raise AssertionError(f"no {error_type.__name__} from {call}")


def check_errors():
    # Caught on every rank before any data moves; the ranks stay in step afterwards.
    expect_error(lambda: tnt.broadcast(np.zeros(2), root=SIZE), ValueError, f"root={SIZE}", "is not a rank")
    expect_error(lambda: tnt.allreduce(tf.constant(["a"])), TypeError, "string")
    expect_error(lambda: tnt.allreduce(np.arange(3), op="mean"), TypeError, "op='mean'", "int64")
    expect_error(lambda: tnt.allreduce(np.zeros(2), op="median"), ValueError, "median")
    expect_error(lambda: tnt.allreduce(np.zeros(2, bool)), TypeError, "booleans")
    if SIZE > 1:
        expect_error(lambda: tnt.allreduce(np.zeros(RANK + 1, np.float32)), ValueError,
                     "value #0", "(1,) on rank 0", "on rank 1", "same dtype and shape")
        expect_error(lambda: tnt.allgather(np.zeros((2, RANK + 1))), ValueError, "shape after the first axis")
        expect_error(lambda: tnt.broadcast(np.zeros(2), root=RANK), ValueError,
                     "different collectives or arguments")
        expect_error(lambda: tnt.allreduce(np.zeros(2)) if RANK else tnt.broadcast(np.zeros(2)), ValueError,
                     "rank 0 called tnt.broadcast", "tnt.allreduce")
        expect_error(lambda: tf.function(tnt.allreduce)(tf.zeros([RANK + 1])), tf.errors.InvalidArgumentError,
                     "value #0", "same dtype and shape")
    np.testing.assert_array_equal(tnt.allreduce(np.ones(2)), np.full(2, float(SIZE)))


# -- custom training loops ---------------------------------------------------------------------------

SAMPLES, GLOBAL_BATCH = 22, 7  # batches 7, 7, 7, 1: uneven on 2 and 3 ranks, and ranks without samples


def build_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])


def dataset():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(SAMPLES, 5)).astype(np.float32)
    y = np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], axis=1).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def loss_of(model, x, y, reduction):
    errors = tf.reduce_sum(tf.square(model(x, training=True) - y), axis=1)
    return tf.reduce_sum(errors) if reduction == "sum" else tf.reduce_mean(errors)


def train_serially(reduction, epochs=1):
    model, optimizer = build_model(), keras.optimizers.Adam(0.02)
    losses = []
    for _ in range(epochs):
        for x, y in dataset():
            with tf.GradientTape() as tape:
                loss = loss_of(model, x, y, reduction)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            losses.append(float(loss))
    return model.get_weights(), losses


def train_distributed(variant, reduction, epochs=1):
    model = build_model()
    optimizer = tnt.optimizers.Optimizer(keras.optimizers.Adam(0.02), loss_reduction=reduction)
    optimizer.build(model.trainable_variables)
    for variable in model.variables + optimizer.variables:  # the broadcast must undo this
        variable.assign(variable + RANK)
    tnt.broadcast_variables(model.variables + optimizer.variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y, reduction)
        grads = tape.gradient(loss, model.trainable_variables)
        samples = tf.shape(x)[0]
        if variant.endswith("apply_gradients"):
            optimizer.apply_gradients(zip(grads, model.trainable_variables), num_samples=samples)
        elif variant.endswith("allreduce_gradients"):
            grads = tnt.optimizers.allreduce_gradients(grads, num_samples=samples, loss_reduction=reduction)
            optimizer.optimizer.apply(grads, model.trainable_variables)
        else:
            optimizer.apply(grads, model.trainable_variables, num_samples=samples)
        # The global loss, from a collective in the same step as the gradient allreduce.
        # A rank without samples has a NaN mean loss, and 0 * NaN is NaN: multiply_no_nan gives 0.
        local = tf.cast(loss, tf.float64) if reduction == "sum" else \
            tf.math.multiply_no_nan(tf.cast(loss, tf.float64), tf.cast(samples, tf.float64))
        totals = tnt.allreduce([local, tf.cast(samples, tf.float64)])
        return totals[0] / (1.0 if reduction == "sum" else totals[1])

    if variant.startswith("function"):
        step = tf.function(step, reduce_retracing=True)
    losses = []
    for _ in range(epochs):
        for x, y in tnt.data.distribute(dataset()):
            losses.append(float(step(x, y)))
    return model.get_weights(), losses


def check_gradient_combination():
    """Weighted by sample counts; also for gradients TensorFlow folds into constants, at every call."""
    bias = tf.Variable([0.0, 0.0])

    @tf.function
    def combined(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(x + bias)  # d loss / d bias = 1/2 per entry, whatever x holds
        grads = tape.gradient(loss, [bias])
        return (tnt.optimizers.allreduce_gradients(grads)[0],
                tnt.optimizers.allreduce_gradients(grads, num_samples=tf.shape(x)[0])[0])

    for _ in range(3):
        for result in combined(tf.ones((4, 2))):
            np.testing.assert_allclose(result.numpy(), [0.5, 0.5], rtol=1e-6)

    # float16 gradients, None entries and IndexedSlices (from an embedding lookup), eagerly.
    grads = [tf.constant([1.0, 2.0], tf.float16) * (RANK + 1), None,
             tf.IndexedSlices(tf.fill([1, 2], float(RANK)), tf.constant([RANK % 2]), tf.constant([2, 2]))]
    combined = tnt.optimizers.allreduce_gradients(grads, num_samples=RANK + 1)
    shares = np.arange(1, SIZE + 1) / np.arange(1, SIZE + 1).sum()
    assert combined[0].dtype == tf.float16 and combined[1] is None
    np.testing.assert_allclose(combined[0].numpy(), (shares * np.arange(1, SIZE + 1)).sum() * np.array([1, 2]),
                               rtol=1e-3)
    embedding = np.zeros((2, 2))
    for rank in range(SIZE):
        embedding[rank % 2] += shares[rank] * rank
    np.testing.assert_allclose(tf.convert_to_tensor(combined[2]).numpy(), embedding, rtol=1e-6, atol=1e-7)


def check_custom_loops():
    lines = []
    variants = [("eager apply", "mean"), ("function apply_gradients", "mean"),
                ("eager allreduce_gradients", "sum")]
    serial = {reduction: train_serially(reduction) for reduction in ("mean", "sum")}
    for variant, reduction in variants:
        weights, losses = train_distributed(variant, reduction)
        serial_weights, serial_losses = serial[reduction]
        weight_error = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, serial_weights))
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses))
        assert weight_error <= 1e-5, (variant, reduction, weight_error)
        assert loss_error <= 1e-5, (variant, reduction, loss_error)
        everyone = tnt.allgather(np.concatenate([w.reshape(-1) for w in weights])[None])
        assert (everyone == everyone[0]).all(), f"{variant}: ranks hold different weights"
        lines.append(f"{variant} ({reduction}) max weight error {weight_error:.1e}, loss error {loss_error:.1e}")
    return lines


if __name__ == "__main__":
    print(f"rank {RANK}: {check_collectives()} collective checks agree with numpy", flush=True)
    check_structures_and_classes()
    print(f"rank {RANK}: structures, classes and broadcast_variables agree", flush=True)
    check_the_original_classes_results()
    print(f"rank {RANK}: the original's classes return what the original's did", flush=True)
    check_errors()
    print(f"rank {RANK}: bad input raised alike", flush=True)
    check_gradient_combination()
    print(f"rank {RANK}: gradients combined as documented", flush=True)
    for line in check_custom_loops() if SIZE > 1 else []:  # one rank: examples/custom_loop.py
        print(f"rank {RANK}: custom loop {line}", flush=True)
    print(f"rank {RANK}: done", flush=True)
