"""keras-io's "Variational AutoEncoder" on Keras' PyTorch backend: an encoder whose Sampling layer
draws epsilon with keras.random and a SeedGenerator, a decoder, and a train_step written as keras-io's
"Customizing what happens in fit() with PyTorch" writes one (zero_grad, the reconstruction and KL
losses, backward, optimizer.apply) that feeds three Mean trackers (total_loss, reconstruction_loss,
kl_loss); a test_step of the same kind, so that evaluate scores held-out images; predict as keras-io
plots the latent space, with the encoder. The VAE's call runs encoder and decoder (Keras builds the
model from it). The networks are keras-io's, smaller; the images are made up (8x8). The last
batch holds one image, so on 2 and 3 ranks some ranks step without samples.
"""

import keras
import numpy as np
import torch
from keras import layers, ops

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(1)


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


latent_dim = 2

encoder_inputs = keras.Input(shape=(8, 8, 1))
x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
x = layers.Flatten()(x)
x = layers.Dense(16, activation="relu")(x)
z_mean = layers.Dense(latent_dim, name="z_mean")(x)
z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
z = Sampling()([z_mean, z_log_var])
encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

latent_inputs = keras.Input(shape=(latent_dim,))
x = layers.Dense(2 * 2 * 16, activation="relu")(latent_inputs)
x = layers.Reshape((2, 2, 16))(x)
x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def call(self, data):
        z_mean, z_log_var, z = self.encoder(data)
        return z_mean, z_log_var, self.decoder(z)

    def losses_of(self, data):
        z_mean, z_log_var, reconstruction = self(data)
        reconstruction_loss = ops.mean(
            ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
        )
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss

    def track(self, total_loss, reconstruction_loss, kl_loss):
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }

    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        self.zero_grad()
        total_loss, reconstruction_loss, kl_loss = self.losses_of(data)
        total_loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        return self.track(total_loss, reconstruction_loss, kl_loss)

    def test_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        return self.track(*self.losses_of(data))


# Made-up images, 357 of 8x8 pixels in [0, 1].
mnist_digits = np.random.default_rng(6).random((357, 8, 8, 1)).astype("float32")
x_train, x_test = mnist_digits[:257], mnist_digits[257:]

model = VAE(encoder, decoder)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam())

history = model.fit(x_train, epochs=2, batch_size=64, verbose=0)

score = model.evaluate(x_test, batch_size=64, verbose=0)
predictions = model.encoder.predict(x_test, verbose=0)
