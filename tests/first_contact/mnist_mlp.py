"""An MLP on 28x28 digits, as TensorFlow's "quickstart for beginners" trains it: Flatten, Dense,
logits with from_logits=True, Adam, validation_split, probabilities by a softmax. The digits are
made up (no downloads here): a fixed pattern per class under heavy noise."""

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(42)

rng = np.random.default_rng(42)
patterns = rng.uniform(0, 255, size=(10, 28, 28))


def make_digits(count):
    labels = rng.integers(0, 10, size=count)
    images = np.clip(patterns[labels] + rng.normal(0, 90, size=(count, 28, 28)), 0, 255).astype("uint8")
    return images, labels


(x_train, y_train), (x_test, y_test) = make_digits(1500), make_digits(300)
x_train, x_test = x_train / 255.0, x_test / 255.0

model = keras.Sequential([
    keras.Input(shape=(28, 28)),
    keras.layers.Flatten(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10),
])
model = tnt.Model(model)

loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer="adam", loss=loss_fn, metrics=["accuracy"])

history = model.fit(x_train, y_train, epochs=3, batch_size=64, validation_split=0.1)

score = model.evaluate(x_test, y_test, verbose=2)
logits = model.predict(x_test)
predictions = keras.ops.convert_to_numpy(keras.ops.softmax(logits))  # the quickstart's Softmax layer
print("first test digits:", np.argmax(predictions[:10], axis=1), "labels:", y_test[:10])
