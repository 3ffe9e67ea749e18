"""keras-io's "Customizing what happens in fit() with PyTorch", its end-to-end GAN: a generator and a
discriminator, compile(d_optimizer=..., g_optimizer=..., loss_fn=...), a train_step that samples
latent vectors with keras.random and a SeedGenerator, trains the discriminator on generated and real
images (labels with random noise added: zero_grad, backward, d_optimizer.apply) and then the generator
(g_optimizer.apply), and feeds two Mean trackers; fit on a DataLoader with shuffle=True. keras-io's
GAN has no test_step: this one adds one of the same kind, so that evaluate scores held-out images;
predict with the generator (the GAN has no call). The networks are keras-io's, smaller; the images
are made up (8x8), with an uneven last batch.
"""

import keras
import numpy as np
import torch
from keras import layers

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(1)

discriminator = keras.Sequential(
    [
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1),
    ],
    name="discriminator",
)

latent_dim = 8
generator = keras.Sequential(
    [
        keras.Input(shape=(latent_dim,)),
        layers.Dense(2 * 2 * 16),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Reshape((2, 2, 16)),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
    ],
    name="generator",
)


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(real_images, (tuple, list)):
            real_images = real_images[0]
        # Sample random points in the latent space
        batch_size = real_images.shape[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        real_images = torch.as_tensor(real_images, device=device)
        combined_images = torch.concat([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = torch.concat(
            [
                torch.ones((batch_size, 1), device=device),
                torch.zeros((batch_size, 1), device=device),
            ],
            axis=0,
        )
        # Add random noise to the labels - important trick!
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)

        # Train the discriminator
        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Assemble labels that say "all real images"
        misleading_labels = torch.zeros((batch_size, 1), device=device)

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

        # Update metrics and return their value.
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }

    def test_step(self, real_images):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(real_images, (tuple, list)):
            real_images = real_images[0]
        # The discriminator's loss on real images (labelled 0), the generator's on generated ones.
        batch_size = real_images.shape[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        zeros = torch.zeros((batch_size, 1), device=device)
        d_loss = self.loss_fn(zeros, self.discriminator(torch.as_tensor(real_images, device=device)))
        g_loss = self.loss_fn(zeros, self.discriminator(self.generator(random_latent_vectors)))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


# Made-up images, 420 of 8x8 pixels in [0, 1].
all_digits = np.random.default_rng(4).random((420, 8, 8, 1)).astype("float32")
x_train, x_test = all_digits[:300], all_digits[300:]

batch_size = 64
dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(x_train))
dataloader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)

model = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
model = tnt.Model(model)
model.compile(
    d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)

history = model.fit(dataloader, epochs=2, verbose=0)

score = model.evaluate(x_test, batch_size=batch_size, verbose=0)
predictions = model.generator.predict(np.random.default_rng(5).normal(size=(16, latent_dim)), verbose=0)
