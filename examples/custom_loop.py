"""A custom training loop (no fit) with tarantella, on synthetic data.

Serial:    python examples/custom_loop.py
Two ranks: tarantella -n 2 -- examples/custom_loop.py

Every rank runs this script and trains on its micro-batches of each global batch; the
combined gradient is the serial one, so 1 and N ranks end with the same weights up to
rounding. `--save-weights FILE` makes the master write the final weights (a .npz file).
"""

import argparse

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf


def synthetic_data(samples, seed):
    """Regression of a smooth function of 8 inputs, with noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8)).astype(np.float32)
    y = (np.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3] + 0.1 * rng.normal(size=(samples, 1))).astype(np.float32)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=999)
    # 999 = 15 x 64 + 39: the last batch splits 20/19 on 2 ranks, every batch unevenly on 3.
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--save-weights", help="the master writes the final weights to this .npz file")
    args = parser.parse_args()

    keras.utils.set_random_seed(args.seed)
    x, y = synthetic_data(args.samples, args.seed)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(args.samples, seed=args.seed)
    dataset = tnt.data.distribute(dataset.batch(args.global_batch_size))  # this rank's micro-batches

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    optimizer = tnt.optimizers.Optimizer(keras.optimizers.Adam(args.learning_rate))
    optimizer.build(model.trainable_variables)
    tnt.broadcast_variables(model.variables + optimizer.variables)  # every rank starts from the master's state
    loss_fn = keras.losses.MeanSquaredError()  # averages over the micro-batch

    @tf.function
    def train_step(x, y):
        samples = tf.shape(x)[0]
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables, num_samples=samples)
        # The global batch's loss: weighted by sample counts, summed over ranks.
        totals = tnt.allreduce([tf.math.multiply_no_nan(loss, tf.cast(samples, tf.float32)),
                                tf.cast(samples, tf.float32)])
        return totals[0], totals[1]

    for epoch in range(args.epochs):
        loss_sum = sample_count = 0.0
        for x_batch, y_batch in dataset:
            batch_loss_sum, batch_samples = train_step(x_batch, y_batch)
            loss_sum += float(batch_loss_sum)
            sample_count += float(batch_samples)
        if tnt.is_master_rank():
            print(f"epoch {epoch + 1}: mean loss {loss_sum / sample_count:.6f} over {sample_count:.0f} samples "
                  f"on {tnt.get_size()} rank(s)", flush=True)

    if args.save_weights and tnt.is_master_rank():
        np.savez(args.save_weights, *model.get_weights())


if __name__ == "__main__":
    main()
