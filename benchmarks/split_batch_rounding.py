"""How far one step's gradients move when a batch is taken in parts, in one process, without tarantella.

A data-parallel step takes the gradient of each rank's part of the global batch, weighted by the
part's share, and sums them (in float32; here in float64, which moves nothing beyond 1e-7); serial
Keras takes the gradient of the whole batch. In exact
arithmetic both are equal. This script measures, for the zoo's mixed-precision model
(tests/workers/zoo.py, "mixed-float16-loss-scale"), the largest relative difference per variable
between the two, under the float32 and mixed_float16 policies, on the Keras backend that
KERAS_BACKEND names. It is the floor below which no data-parallel run can agree with serial Keras,
and the evidence behind the zoo's bounds for float16.

    KERAS_BACKEND=jax python benchmarks/split_batch_rounding.py --parts 2
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH = 16
LOSS_SCALE = 2.0 ** 15  # LossScaleOptimizer's initial scale: float16 gradients without it underflow


def build():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((16, 16, 3)), layers.Conv2D(8, 3, activation="relu", name="conv_1"), layers.MaxPooling2D(),
        layers.Conv2D(16, 3, activation="relu", name="conv_2"), layers.GlobalAveragePooling2D(),
        layers.Dense(16, activation="relu", name="dense_1"), layers.Dense(3, name="dense_2"),
        layers.Activation("softmax", dtype="float32")])


def gradient_function(model, scale):
    """gradient(x, y, weight): the model's gradients of weight * loss(x, y), as float64 arrays."""
    loss_of = keras.losses.SparseCategoricalCrossentropy()
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def scaled_loss(trainable, x, y):
            outputs, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return loss_of(y, outputs) * scale

        return lambda x, y, weight: [np.asarray(g, np.float64) * weight / scale
                                     for g in jax.grad(scaled_loss)(trainable, x, y)]
    if backend == "torch":
        import torch

        def gradient(x, y, weight):
            model.zero_grad()
            loss = loss_of(torch.as_tensor(y), model(torch.as_tensor(x), training=True)) * scale
            loss.backward()
            return [v.value.grad.detach().cpu().numpy().astype(np.float64) * weight / scale
                    for v in model.trainable_variables]

        return gradient
    import tensorflow as tf

    def gradient(x, y, weight):
        with tf.GradientTape() as tape:
            loss = loss_of(y, model(x, training=True)) * scale
        return [np.asarray(g, np.float64) * weight / scale for g in tape.gradient(loss, model.trainable_variables)]

    return gradient


def largest_changes(policy, parts):
    """{variable: max |whole - sum of parts| / max |whole|} for one step under `policy`."""
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(3)
    model = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    gradient = gradient_function(model, LOSS_SCALE if policy == "mixed_float16" else 1.0)
    whole = gradient(x, y, 1.0)
    summed = None
    for rows in np.array_split(np.arange(BATCH), parts):
        part = gradient(x[rows], y[rows], len(rows) / BATCH)
        summed = part if summed is None else [a + b for a, b in zip(summed, part)]
    layer_of = {id(v): layer.name for layer in model.layers for v in layer.trainable_variables}
    return {f"{layer_of[id(v)]}/{v.name}": float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
            for v, a, b in zip(model.trainable_variables, whole, summed)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=2, help="parts the batch of 16 is taken in (ranks)")
    args = parser.parse_args()
    print(f"Keras backend {keras.backend.backend()}; a batch of {BATCH} against {args.parts} parts summed in "
          "float64; largest relative gradient difference per variable:")
    for policy in ("float32", "mixed_float16"):
        changes = largest_changes(policy, args.parts)
        print(f"  {policy:14s} " + ", ".join(f"{name} {change:.1e}" for name, change in changes.items()))


if __name__ == "__main__":
    main()
