"""An overridden train_step and test_step, trained data-parallel with tarantella.

Serial:    python examples/custom_train_step.py
Two ranks: tarantella -n 2 -- examples/custom_train_step.py

The model follows keras-io's "Customizing what happens in fit()": the step computes the
loss with `compute_loss`, applies the gradients itself, and updates its metrics. Wrapped in
tnt.Model, the step runs on each rank's share of every global batch; tarantella sums the
gradients (weighted by each rank's share) before the update and combines the metrics, so
the History printed at the end is the serial one on any number of ranks.
"""

import argparse

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf


class WeightedRegressor(keras.Model):
    """Sample-weighted regression with a hand-written train and test step."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return self.track(loss, y, y_pred, sample_weight)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        return self.track(loss, y, y_pred, sample_weight)

    def track(self, loss, y, y_pred, sample_weight):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


def synthetic_data(samples, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] ** 2 + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    weights = rng.uniform(0.5, 1.5, samples).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y, weights))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    keras.utils.set_random_seed(7)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Dense(32, activation="relu")(inputs))
    model = tnt.Model(WeightedRegressor(inputs, keras.layers.Dense(1)(hidden)))
    model.compile(keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])

    train = synthetic_data(args.samples, seed=1).shuffle(args.samples, seed=3).batch(args.batch_size)
    validation = synthetic_data(args.samples // 4, seed=2).batch(args.batch_size)
    history = model.fit(train, validation_data=validation, epochs=args.epochs,
                        verbose=2 if tnt.is_master_rank() else 0)
    if tnt.is_master_rank():
        for key, values in sorted(history.history.items()):
            print(f"history {key}: {' '.join(f'{v:.7g}' for v in values)}")
        print(f"trained on {tnt.get_size()} rank(s)")


if __name__ == "__main__":
    main()
