"""keras-io's end-to-end GAN ("Customizing what happens in fit()"), written as its JAX guide writes a
step: a stateless train_step(state, data) that samples latent vectors with keras.random and a
SeedGenerator (its state is the model's non-trainable state, held in a StatelessScope), trains the
discriminator on generated and real images (labels with random noise added: stateless_call,
jax.value_and_grad, d_optimizer.stateless_apply) and then the generator (g_optimizer.stateless_apply),
and feeds two Mean trackers statelessly; a test_step of the same kind scores held-out images. Keras'
JAX trainer carries the state of the compiled optimizer from step to step, so compile(d_optimizer=...,
g_optimizer=..., loss_fn=...) compiles a MultiOptimizer that holds both. fit on arrays, with its
default shuffle; predict with the generator (the GAN has no call). The networks are keras-io's,
smaller; the images are made up (8x8), with an uneven last batch.
"""

import jax
import keras
import numpy as np
from keras import layers, ops

import tarantella as tnt

BACKENDS = ("jax",)

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


def values_of(variables, state_variables, state_values):
    """The values that the state (`state_values`, one for each of `state_variables`) holds for `variables`."""
    position = {id(v): i for i, v in enumerate(state_variables)}
    return [state_values[position[id(v)]] for v in variables]


def with_values(state_variables, state_values, variables, values):
    """The state with `values` for `variables`."""
    new = dict(zip(map(id, variables), values))
    return [new.get(id(v), value) for v, value in zip(state_variables, state_values)]


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
        super().compile(
            optimizer=keras.optimizers.MultiOptimizer(
                keras.optimizers.OptimizerMap(g_optimizer, {"discriminator/.*": d_optimizer})
            )
        )
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def update_trackers(self, metrics_variables, d_loss, g_loss):
        d_vars = metrics_variables[: len(self.d_loss_tracker.variables)]
        g_vars = metrics_variables[len(self.d_loss_tracker.variables) :]
        d_vars = self.d_loss_tracker.stateless_update_state(d_vars, d_loss)
        g_vars = self.g_loss_tracker.stateless_update_state(g_vars, g_loss)
        logs = {
            "d_loss": self.d_loss_tracker.stateless_result(d_vars),
            "g_loss": self.g_loss_tracker.stateless_result(g_vars),
        }
        return d_vars + g_vars, logs

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        real_images = data[0] if isinstance(data, tuple) else data
        batch_size = real_images.shape[0]
        d_vars = values_of(self.discriminator.trainable_variables, self.trainable_variables, trainable_variables)
        g_vars = values_of(self.generator.trainable_variables, self.trainable_variables, trainable_variables)
        d_opt_vars = values_of(self.d_optimizer.variables, self.optimizer.variables, optimizer_variables)
        g_opt_vars = values_of(self.g_optimizer.variables, self.optimizer.variables, optimizer_variables)

        # The seed generator's state is non-trainable state: draw in a StatelessScope that holds it.
        with keras.StatelessScope(
            state_mapping=list(zip(self.non_trainable_variables, non_trainable_variables))
        ) as scope:
            # Sample random points in the latent space
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
            # Noise for the labels, and the points the generator trains on
            label_noise = keras.random.uniform((2 * batch_size, 1), seed=self.seed_generator)
            generator_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
        non_trainable_variables = [scope.get_current_value(v) for v in self.non_trainable_variables]

        # Decode them to fake images, combine them with real images
        generated_images, _ = self.generator.stateless_call(g_vars, [], random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images; add random noise - important trick!
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * label_noise

        # Train the discriminator
        def d_loss_fn(d_vars):
            predictions, _ = self.discriminator.stateless_call(d_vars, [], combined_images)
            return self.loss_fn(labels, predictions)

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(d_vars)
        d_vars, d_opt_vars = self.d_optimizer.stateless_apply(d_opt_vars, d_grads, d_vars)

        # Train the generator (the discriminator's weights are not updated), with labels that say
        # "all real images"
        misleading_labels = ops.zeros((batch_size, 1))

        def g_loss_fn(g_vars):
            generated, _ = self.generator.stateless_call(g_vars, [], generator_latent_vectors)
            predictions, _ = self.discriminator.stateless_call(d_vars, [], generated)
            return self.loss_fn(misleading_labels, predictions)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(g_vars)
        g_vars, g_opt_vars = self.g_optimizer.stateless_apply(g_opt_vars, g_grads, g_vars)

        metrics_variables, logs = self.update_trackers(metrics_variables, d_loss, g_loss)
        trainable_variables = with_values(
            self.trainable_variables,
            trainable_variables,
            self.discriminator.trainable_variables + self.generator.trainable_variables,
            d_vars + g_vars,
        )
        optimizer_variables = with_values(
            self.optimizer.variables,
            optimizer_variables,
            self.d_optimizer.variables + self.g_optimizer.variables,
            d_opt_vars + g_opt_vars,
        )
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        real_images = data[0] if isinstance(data, tuple) else data
        batch_size = real_images.shape[0]
        d_vars = values_of(self.discriminator.trainable_variables, self.trainable_variables, trainable_variables)
        g_vars = values_of(self.generator.trainable_variables, self.trainable_variables, trainable_variables)
        with keras.StatelessScope(
            state_mapping=list(zip(self.non_trainable_variables, non_trainable_variables))
        ) as scope:
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator
            )
        non_trainable_variables = [scope.get_current_value(v) for v in self.non_trainable_variables]
        # The discriminator's loss on real images (labelled 0), the generator's on generated ones.
        zeros = ops.zeros((batch_size, 1))
        real_predictions, _ = self.discriminator.stateless_call(d_vars, [], real_images)
        generated_images, _ = self.generator.stateless_call(g_vars, [], random_latent_vectors)
        generated_predictions, _ = self.discriminator.stateless_call(d_vars, [], generated_images)
        d_loss = self.loss_fn(zeros, real_predictions)
        g_loss = self.loss_fn(zeros, generated_predictions)
        metrics_variables, logs = self.update_trackers(metrics_variables, d_loss, g_loss)
        return logs, (trainable_variables, non_trainable_variables, metrics_variables)


# Made-up images, 420 of 8x8 pixels in [0, 1].
all_digits = np.random.default_rng(4).random((420, 8, 8, 1)).astype("float32")
x_train, x_test = all_digits[:300], all_digits[300:]

batch_size = 64
model = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
model = tnt.Model(model)
model.compile(
    d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)

history = model.fit(x_train, batch_size=batch_size, epochs=2, verbose=0)

score = model.evaluate(x_test, batch_size=batch_size, verbose=0)
predictions = model.generator.predict(np.random.default_rng(5).normal(size=(16, latent_dim)), verbose=0)
