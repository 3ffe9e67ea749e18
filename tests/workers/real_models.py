"""Models of the shapes users train, and custom training logic, serially and under tarantella.

`--mode serial` uses plain Keras and never imports tarantella; `--mode tnt` wraps every
model in tnt.Model. Each case writes one npz per rank with weights, History, evaluation and
predictions; tests/test_real_models.py compares them. Cases follow keras-io patterns:
Embedding models, Dense on 3-D inputs, parallel branches added, masked sequence losses,
attention taggers whose losses ignore a class, under padding masks and with per-token
sample weights, layers that own metrics and add losses, a Conv2D model whose last global
batch has a single sample, a summed loss, and overridden train_step/test_step/compute_loss
(keras-io's guide models, a GAN with two optimizers, a VAE, knowledge distillation). Random
draws of the custom steps (latent vectors) come with the data, so a serial run draws the
same numbers.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES = 135  # with batch 64: 64, 64, 7 (7 splits 4/3 on 2 ranks, 3/2/2 on 3)
BATCH = 64


# -- models with built-in steps -----------------------------------------------------------------

def embedding_adam(keras, np, tf, wrap):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 12, (SAMPLES, 6))  # a small vocabulary: rows repeat within a batch
    labels = rng.integers(0, 3, SAMPLES)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(12, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, activation="softmax")])
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((tokens, labels))


def dense_on_3d(keras, np, tf, wrap):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES, 5, 4)).astype("float32")
    y = rng.integers(0, 3, SAMPLES)
    inputs = keras.Input((5, 4))
    hidden = keras.layers.Dense(6, activation="relu")(inputs)  # an einsum over the sequence
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(6)(hidden))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((x, y))


def parallel_branches_added(keras, np, tf, wrap):
    """Two Dense layers read the same input and their outputs are added (multi-branch blocks):
    their kernels get equal gradients, which TensorFlow computes once. Each kernel is 32 KB, so
    at the default fusion threshold each travels in a bucket of its own."""
    rng = np.random.default_rng(13)
    x = rng.normal(size=(SAMPLES, 64)).astype("float32")
    y = rng.integers(0, 3, SAMPLES)
    inputs = keras.Input((64,))
    added = keras.layers.Add()([keras.layers.Dense(128)(inputs), keras.layers.Dense(128)(inputs)])
    outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.ReLU()(added))
    model = wrap(keras.Model(inputs, outputs))
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((x, y))


def masked_sequence(keras, np, tf, wrap):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 9, SAMPLES)
    tokens = rng.integers(1, 20, (SAMPLES, 8)) * (np.arange(8)[None, :] < lengths[:, None])
    tags = rng.integers(0, 4, (SAMPLES, 8))
    model = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(20, 8, mask_zero=True),
                              keras.layers.LSTM(8, return_sequences=True),
                              keras.layers.Dense(4, activation="softmax")])
    model = wrap(model)
    model.compile(keras.optimizers.RMSprop(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((tokens, tags))


def _padded_sequences(np, rng, length=12, vocabulary=20):
    """Tokens padded with 0 at the end, and targets padded where the tokens are (0: ignored)."""
    lengths = rng.integers(2, length + 1, SAMPLES)
    filled = np.arange(length)[None, :] < lengths[:, None]
    return (rng.integers(1, vocabulary, (SAMPLES, length)) * filled,
            rng.integers(1, vocabulary, (SAMPLES, length)) * filled)


def _attention_tagger(keras, mask_zero, outputs=1, length=12, vocabulary=20):
    """Embedding, self-attention, LayerNormalization(h + a), a Dense per output: per-token logits."""
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 16, mask_zero=mask_zero)(tokens)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
    # Named: the per-output losses are logged by layer name, which must not depend on the cases run before.
    heads = [keras.layers.Dense(vocabulary, name=f"logits_{i}")(h) for i in range(outputs)]
    return keras.Model(tokens, heads if outputs > 1 else heads[0])


def attention_ignore_class(keras, np, tf, wrap):
    """Issue 18: ignore_class masks the per-token losses, not the output; each rank has its own
    count of ignored targets, and Keras divides by the count of the others."""
    tokens, targets = _padded_sequences(np, np.random.default_rng(14))
    model = wrap(_attention_tagger(keras, mask_zero=False))
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    return model, tf.data.Dataset.from_tensor_slices((tokens, targets))


def attention_mask_and_ignore_class(keras, np, tf, wrap):
    """The attention's output carries the tokens' padding mask, and ignore_class masks targets
    padded elsewhere (next-token targets end one step earlier): Keras divides by the count of
    entries both leave, with RMSprop as in keras-io's translation example."""
    tokens, _ = _padded_sequences(np, np.random.default_rng(15))
    next_tokens = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    model = wrap(_attention_tagger(keras, mask_zero=True))
    model.compile(keras.optimizers.RMSprop(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model, tf.data.Dataset.from_tensor_slices((tokens, next_tokens))


def masked_losses_with_sample_weight(keras, np, tf, wrap):
    """Per-token sample weights (some 0) under the padding mask and ignore_class, in both mean
    reductions: "sum_over_batch_size" divides by the unmasked count, "mean_with_sample_weight"
    by the unmasked weights' sum."""
    rng = np.random.default_rng(16)
    tokens, targets = _padded_sequences(np, rng)
    targets[:, 0] = 0  # ignored although unpadded
    weights = (rng.random(tokens.shape) * (rng.random(tokens.shape) > 0.2)).astype("float32")
    model = wrap(_attention_tagger(keras, mask_zero=True, outputs=2))
    ignoring = lambda reduction: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0, reduction=reduction)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                  [ignoring("sum_over_batch_size"), ignoring("mean_with_sample_weight")])
    return model, tf.data.Dataset.from_tensor_slices((tokens, (targets, targets), weights))


def layer_owned_metric(keras, np, tf, wrap):
    class LogisticEndpoint(keras.layers.Layer):
        """keras-io's endpoint layer: it adds its loss and updates its own accuracy metric."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
            self.accuracy_metric = keras.metrics.BinaryAccuracy(name="endpoint_accuracy")
            self.activity = keras.metrics.Mean(name="logit_mean")

        def call(self, targets, logits, sample_weights=None):
            self.add_loss(self.loss_fn(targets, logits, sample_weights))
            self.accuracy_metric.update_state(targets, keras.ops.sigmoid(logits), sample_weights)
            self.activity.update_state(logits)
            return keras.ops.sigmoid(logits)

    rng = np.random.default_rng(4)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    targets = (rng.random((SAMPLES, 1)) > 0.5).astype("float32")
    inputs, target_input = keras.Input((6,), name="inputs"), keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = keras.Model([inputs, target_input], LogisticEndpoint()(target_input, logits))
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.02))
    return model, tf.data.Dataset.from_tensor_slices(((x, targets),))


def conv_single_sample_last_batch(keras, np, tf, wrap):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(33, 8, 8, 1)).astype("float32")  # batch 32: the last global batch has 1 sample
    y = rng.integers(0, 3, 33)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                              keras.layers.Dense(3, activation="softmax")])
    model = wrap(model)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((x, y)), 32


def summed_loss(keras, np, tf, wrap):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = rng.normal(size=(SAMPLES, 2)).astype("float32")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    model = wrap(model)
    model.compile(keras.optimizers.SGD(0.001), keras.losses.MeanSquaredError(reduction="sum"), metrics=["mae"])
    return model, tf.data.Dataset.from_tensor_slices((x, y))


def synchronized_batch_normalization(keras, np, tf, wrap):
    rng = np.random.default_rng(13)
    # The first channel's mean is large against its spread: the first layer's moments must be
    # combined without summing squares in float32, where E[x^2] - E[x]^2 would cancel.
    x = (rng.normal(size=(SAMPLES, 6, 6, 2)) + [30.0, 0.0]).astype("float32")
    y = rng.integers(0, 3, SAMPLES)
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.BatchNormalization(),
                              keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                              keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3, activation="softmax")])
    if wrap is not _serial:  # the option under test; serially, plain BatchNormalization is the reference
        model = wrap(model, synchronized_batch_normalization=True)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, tf.data.Dataset.from_tensor_slices((x, y))


# -- overridden steps ---------------------------------------------------------------------------

def _regression_data(np, tf, seed, with_weights=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    if with_weights:
        return tf.data.Dataset.from_tensor_slices((x, y, rng.random(SAMPLES).astype("float32")))
    return tf.data.Dataset.from_tensor_slices((x, y))


def custom_train_step(keras, np, tf, wrap):
    class CustomModel(keras.Model):
        """keras-io 'customizing what happens in fit', first example."""

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((5,))
    model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs)))
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model, _regression_data(np, tf, 7)


def custom_train_step_sample_weight(keras, np, tf, wrap):
    class CustomModel(keras.Model):
        """keras-io's example with sample_weight support."""

        def train_step(self, data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred, sample_weight=sample_weight)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((5,))
    model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs)))
    model = wrap(model)
    model.compile(keras.optimizers.SGD(0.02, momentum=0.9), loss="mse", metrics=["mae"])
    return model, _regression_data(np, tf, 8, with_weights=True)


def custom_test_step(keras, np, tf, wrap):
    class CustomModel(keras.Model):
        """keras-io's custom evaluation step, with trackers of its own."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self.loss_tracker.update_state(keras.losses.mean_squared_error(y, y_pred))
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = keras.ops.mean(keras.losses.mean_squared_error(y, y_pred))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result(), "batch_loss": loss}

    inputs = keras.Input((5,))
    model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs)))
    model = wrap(model)
    model.compile(keras.optimizers.RMSprop(0.01))
    return model, _regression_data(np, tf, 9)


def gan(keras, np, tf, wrap):
    latent = 4

    class GAN(keras.Model):
        """keras-io's GAN pattern, two optimizers and a compile of its own; latent vectors come
        with the data so that every run draws the same ones."""

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
            real, noise_d, noise_g = data
            fake = self.generator(noise_d)
            images = keras.ops.concatenate([fake, real], axis=0)
            batch = keras.ops.shape(real)[0]
            labels = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(images))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(keras.ops.zeros((batch, 1)), self.discriminator(self.generator(noise_g)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(6)])
    model = GAN(discriminator, generator)
    model = wrap(model)
    model.compile(d_optimizer=keras.optimizers.Adam(0.003), g_optimizer=keras.optimizers.Adam(0.003),
                  loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(10)
    real = rng.normal(size=(SAMPLES, 6)).astype("float32")
    noise = rng.normal(size=(2, SAMPLES, latent)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((real, noise[0], noise[1]))


def vae(keras, np, tf, wrap):
    latent = 2

    class VAE(keras.Model):
        """keras-io's VAE: reconstruction and KL terms in a custom step; epsilon comes with the data."""

        def __init__(self, encoder, decoder):
            super().__init__()
            self.encoder, self.decoder = encoder, decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def train_step(self, data):
            x, epsilon = data
            with tf.GradientTape() as tape:
                z_mean, z_log_var = self.encoder(x)
                z = z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon
                reconstruction = self.decoder(z)
                reconstruction_loss = keras.ops.mean(keras.ops.sum(
                    keras.losses.binary_crossentropy(x[..., None], reconstruction[..., None]), axis=1))
                kl = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
                kl_loss = keras.ops.mean(keras.ops.sum(kl, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(6, activation="relu")(inputs)
    encoder = keras.Model(inputs, [keras.layers.Dense(latent)(hidden), keras.layers.Dense(latent)(hidden)])
    decoder = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(6, activation="relu"),
                                keras.layers.Dense(8, activation="sigmoid")])
    model = VAE(encoder, decoder)
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.01))
    rng = np.random.default_rng(11)
    x = rng.random((SAMPLES, 8)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, rng.normal(size=(SAMPLES, latent)).astype("float32")))


def distillation(keras, np, tf, wrap):
    class Distiller(keras.Model):
        """keras-io's knowledge distillation: a frozen teacher and an overridden compute_loss."""

        def __init__(self, student, teacher):
            super().__init__()
            self.teacher, self.student = teacher, student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
            self.alpha, self.temperature = alpha, temperature

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False, training=True):
            teacher_pred = self.teacher(x, training=False)
            student_loss = self.student_loss_fn(y, y_pred)
            distillation_loss = self.distillation_loss_fn(
                keras.ops.softmax(teacher_pred / self.temperature, axis=1),
                keras.ops.softmax(y_pred / self.temperature, axis=1)) * self.temperature ** 2
            return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        def call(self, x):
            return self.student(x)

    def classifier(width):
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="relu"),
                                 keras.layers.Dense(3)])

    teacher = classifier(16)
    teacher.trainable = False
    model = Distiller(classifier(4), teacher)
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.01), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.3, temperature=2)
    rng = np.random.default_rng(12)
    return model, tf.data.Dataset.from_tensor_slices((rng.normal(size=(SAMPLES, 6)).astype("float32"),
                                                      rng.integers(0, 3, SAMPLES)))


# name: (builder, evaluate and predict as Keras would)
CASES = {
    "embedding-adam": (embedding_adam, True),
    "dense-3d": (dense_on_3d, True),
    "parallel-branches-added": (parallel_branches_added, True),
    "masked-sequence": (masked_sequence, True),
    "attention-ignore-class": (attention_ignore_class, True),
    "attention-mask-and-ignore-class": (attention_mask_and_ignore_class, True),
    "masked-losses-with-sample-weight": (masked_losses_with_sample_weight, True),
    "layer-owned-metric": (layer_owned_metric, True),
    "conv-single-sample-last-batch": (conv_single_sample_last_batch, True),
    "summed-loss": (summed_loss, True),
    "synchronized-batch-normalization": (synchronized_batch_normalization, True),
    "custom-train-step": (custom_train_step, True),
    "custom-train-step-sample-weight": (custom_train_step_sample_weight, True),
    "custom-test-step": (custom_test_step, True),
    "gan-two-optimizers": (gan, False),
    "vae": (vae, False),
    "distillation": (distillation, True),
}


def run_case(name, mode, out_dir):
    import keras
    import numpy as np
    import tensorflow as tf

    builder, evaluates = CASES[name]
    keras.utils.set_random_seed(21)
    rank, wrap = 0, _serial
    if mode == "tnt":
        import tarantella as tnt
        rank, wrap = tnt.get_rank(), tnt.Model
    built = builder(keras, np, tf, wrap)
    model, dataset, batch = built if len(built) == 3 else (*built, BATCH)
    batched = dataset.batch(batch)
    history = model.fit(batched, epochs=2, verbose=0)
    arrays = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    if evaluates:
        evaluation = model.evaluate(batched, verbose=0, return_dict=True)
        arrays.update({f"evaluate_{key}": np.array(value) for key, value in evaluation.items()})
        x_only = batched.map(lambda *element: element[0] if len(element) > 1 else element)
        arrays["predictions"] = np.concatenate(
            [np.reshape(p, (len(p), -1)) for p in _as_list(model.predict(x_only, verbose=0))], axis=1)
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **arrays)


def _serial(model):
    return model


def _as_list(predictions):
    return predictions if isinstance(predictions, (list, tuple)) else [predictions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before TensorFlow runs, as users should)
    for name in args.cases.split(","):
        run_case(name, args.mode, args.out)


if __name__ == "__main__":
    sys.exit(main())
