"""The public collectives on Keras' JAX and torch backends (KERAS_BACKEND picks), outside any
compiled step, against NumPy; and a custom training loop built from them, against serial Keras.

- tnt.allreduce (every op), tnt.broadcast (root 0 and the last rank) and tnt.allgather (rows
  differing per rank, none on some) on NumPy arrays of every dtype and shape that
  tests/workers/user_collectives.py checks on TensorFlow (its inputs and expected values are
  reused), and on JAX arrays on JAX and torch tensors on torch (float32, needing their gradient,
  and bfloat16); NumPy comes back. tnt.barrier.
- keras.Variables: tnt.broadcast_variables on a model's variables, and a Keras metric combined by
  summing its state with tnt.allreduce (docs/guide.md, "Custom training loops").
- A custom training loop without tnt.optimizers (refused on these backends): each rank takes its
  rows of each global batch from tnt.data.distribute, computes its gradients with the backend
  (jax.grad of a stateless_call, or torch's backward), weights them by its share m/B, sums them
  with tnt.allreduce and applies them with a Keras optimizer. It must end with the weights of the
  same loop run serially on whole batches (global batches of 7 of 22 samples: uneven, and a last
  one of 1 that leaves ranks empty).

Each rank prints "rank R: ..." lines and "rank R: done" at the end; a failed check raises.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tarantella as tnt  # noqa: E402
import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import user_collectives as shared  # noqa: E402  (tests/workers: inputs and checks of the TensorFlow test)

BACKEND = keras.backend.backend()
RANK, SIZE = tnt.get_rank(), tnt.get_size()


def torch_tensor(array):
    """`array` as a torch tensor of its dtype (bfloat16 included), one that needs its gradient where it
    is a float: the collectives take it as a user's tensor in a loop would be."""
    import torch
    array = np.asarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    tensor = torch.from_numpy(array.copy())
    return tensor.requires_grad_() if tensor.is_floating_point() else tensor


def check_arrays():
    """Every dtype on NumPy arrays; float32 and bfloat16 also as JAX arrays on JAX, torch tensors on torch."""
    checks = 0
    for case, dtype in enumerate(shared.FLOATS + shared.INTEGERS + [np.complex64, np.bool_]):
        everyone = [[shared.value_of(rank, (case, i), shape, dtype) for rank in range(SIZE)]
                    for i, shape in enumerate(shared.SHAPES)]
        everyone_rows = [[shared.value_of(rank, (case, i, 1), (rank % 3,) + shape[1:] if shape else (), dtype)
                          for rank in range(SIZE)] for i, shape in enumerate(shared.SHAPES)]
        ops = shared.ops_for(dtype)
        expected = shared.expected_results(everyone, everyone_rows, ops)
        tolerance = 1e-2 if dtype in (np.float16, ml_dtypes.bfloat16) else 1e-6
        kinds = ["numpy"]
        if dtype in (np.float32, ml_dtypes.bfloat16):
            kinds.append({"jax": "jax", "torch": "torch"}[BACKEND])
        for kind in kinds:
            convert = np.asarray
            if kind == "jax":
                import jax.numpy as jnp
                convert = jnp.asarray
            elif kind == "torch":
                convert = torch_tensor
            values = [convert(inputs[RANK]) for inputs in everyone]
            rows = [convert(r[RANK]) for r in everyone_rows]
            results = shared.collectives_on(values, rows, ops)
            for number, (result, wanted) in enumerate(zip(results, expected)):
                assert isinstance(result, np.ndarray), (kind, type(result))
                shared.check(result, wanted, f"{kind} {np.dtype(dtype).name} result #{number}", tolerance)
                checks += 1
    tnt.barrier()
    return checks


def check_variables():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    initial = [keras.ops.convert_to_numpy(v.value) for v in model.variables]
    for variable, value in zip(model.variables, initial):  # the broadcast must undo this
        variable.assign(value + RANK)
    tnt.broadcast_variables(model.variables, root=SIZE - 1)
    for variable, value in zip(model.variables, initial):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable.value), value + (SIZE - 1),
                                      err_msg=variable.path)
    # A Keras metric's summed state gives the serial result.
    mean = keras.metrics.Mean()
    mean.update_state(np.arange(RANK + 1, dtype=np.float32))
    totals = tnt.allreduce(mean.variables)
    assert all(isinstance(total, np.ndarray) for total in totals), [type(total) for total in totals]
    for variable, total in zip(mean.variables, totals):
        variable.assign(total)
    everything = np.concatenate([np.arange(rank + 1) for rank in range(SIZE)])
    np.testing.assert_allclose(float(keras.ops.convert_to_numpy(mean.result())), everything.mean(), rtol=1e-6)


SAMPLES, GLOBAL_BATCH = 22, 7  # batches of 7, 7, 7 and 1


def loop_data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(SAMPLES, 5)).astype(np.float32)
    y = np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], axis=1).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def loop_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def gradients(model, x, y):
    """The gradients of the mean squared error over (x, y), as NumPy arrays."""
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss_of(trainable):
            outputs, _ = model.stateless_call(trainable, non_trainable, x)
            return jnp.mean(jnp.square(outputs - y))

        return [np.asarray(g) for g in jax.grad(loss_of)([v.value for v in model.trainable_variables])]
    for variable in model.trainable_variables:
        variable.value.grad = None
    loss = keras.ops.mean(keras.ops.square(model(x) - keras.ops.convert_to_tensor(y)))
    loss.backward()
    return [variable.value.grad.detach().cpu().numpy() for variable in model.trainable_variables]


def check_custom_loop():
    serial, serial_optimizer = loop_model(), keras.optimizers.Adam(0.02)
    for x, y in loop_data().as_numpy_iterator():
        serial_optimizer.apply([keras.ops.convert_to_tensor(g) for g in gradients(serial, x, y)],
                               serial.trainable_variables)

    model, optimizer = loop_model(), keras.optimizers.Adam(0.02)
    for x, y in tnt.data.distribute(loop_data()).as_numpy_iterator():
        samples = len(x)
        global_samples = int(tnt.allreduce(np.array(samples)))
        # A rank without samples contributes zeros (the mean over no samples is NaN).
        local = gradients(model, x, y) if samples else [np.zeros(v.shape, v.dtype) for v in model.trainable_variables]
        summed = tnt.allreduce([g * (samples / global_samples) for g in local])
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in summed], model.trainable_variables)

    weights = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
    expected = [keras.ops.convert_to_numpy(v.value) for v in serial.trainable_variables]
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, expected))
    assert error <= 1e-5, error
    everyone = tnt.allgather(np.concatenate([w.reshape(-1) for w in weights])[None])
    assert (everyone == everyone[0]).all(), "ranks hold different weights"
    return error


def check_bfloat16_loop_gradients():
    """torch: tnt.optimizers.allreduce_gradients on a bfloat16 gradient gives the ranks' mean in
    bfloat16 (its values exact in bfloat16), beside a float32 one."""
    import torch
    own = torch.full((3,), 1.0 + RANK, dtype=torch.bfloat16), torch.full((2,), 2.0 * RANK)
    summed = tnt.optimizers.allreduce_gradients(list(own))
    assert [g.dtype for g in summed] == [torch.bfloat16, torch.float32], [g.dtype for g in summed]
    assert summed[0].tolist() == [1.0 + (SIZE - 1) / 2] * 3 and summed[1].tolist() == [float(SIZE - 1)] * 2, summed


if __name__ == "__main__":
    print(f"rank {RANK}: {check_arrays()} collective checks on {BACKEND} agree with numpy", flush=True)
    if BACKEND == "torch":
        check_bfloat16_loop_gradients()
    check_variables()
    print(f"rank {RANK}: broadcast_variables and a metric's summed state agree", flush=True)
    print(f"rank {RANK}: custom loop max weight error {check_custom_loop():.1e}", flush=True)
    print(f"rank {RANK}: done", flush=True)
