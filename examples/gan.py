"""A GAN with two optimizers and its own compile(), trained data-parallel with tarantella.

Serial:    python examples/gan.py
Two ranks: tarantella -n 2 -- examples/gan.py

The generator learns to draw points on a ring. The model follows keras-io's GAN pattern:
`compile(d_optimizer=..., g_optimizer=..., loss_fn=...)` and a train_step that updates the
discriminator, then the generator. tarantella combines the gradients each optimizer
applies and the loss trackers, so every rank logs the serial values.

The latent vectors come with the data (two per sample), not from a random call inside the
step: then each sample gets the same vectors on any number of ranks, and the run equals the
serial one. Drawn inside the step, they would differ per rank (training is statistically
the same, but not equal to a serial run).
"""

import argparse

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf

LATENT = 8


class GAN(keras.Model):
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, latent_for_d, latent_for_g = data
        batch = keras.ops.shape(real)[0]
        fake = self.generator(latent_for_d)
        points = keras.ops.concatenate([fake, real], axis=0)
        labels = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(points))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        misleading = keras.ops.zeros((batch, 1))  # "real" for the discriminator
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(latent_for_g)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def ring_points(samples, seed):
    rng = np.random.default_rng(seed)
    angle = rng.uniform(0, 2 * np.pi, samples)
    points = np.stack([np.cos(angle), np.sin(angle)], axis=1) + 0.05 * rng.normal(size=(samples, 2))
    latent = rng.normal(size=(2, samples, LATENT))
    return tf.data.Dataset.from_tensor_slices(
        (points.astype("float32"), latent[0].astype("float32"), latent[1].astype("float32")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    keras.utils.set_random_seed(5)
    discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)])
    gan = tnt.Model(GAN(discriminator, generator))
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5),
                g_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(ring_points(args.samples, seed=1).batch(args.batch_size), epochs=args.epochs,
                      verbose=2 if tnt.is_master_rank() else 0)
    if tnt.is_master_rank():
        radius = np.linalg.norm(generator.predict(np.random.default_rng(9).normal(size=(512, LATENT)),
                                                  verbose=0), axis=1)
        for key, values in sorted(history.history.items()):
            print(f"history {key}: {' '.join(f'{v:.7g}' for v in values)}")
        print(f"generated points: mean distance from the centre {radius.mean():.3f} (the ring's is 1)")
        print(f"trained on {tnt.get_size()} rank(s)")


if __name__ == "__main__":
    main()
