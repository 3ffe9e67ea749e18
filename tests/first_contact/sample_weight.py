"""Per-sample weights, as the Keras guide "Training & evaluation with the built-in methods" passes
them: its functional get_uncompiled_model() (784 -> 64 -> 64 -> 10 softmax), RMSprop,
SparseCategoricalCrossentropy, the class-5 samples weighted 2.0 through `sample_weight`, a held-out
validation set. The digits are made up: flattened noisy patterns per class."""

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(5)

rng = np.random.default_rng(5)
patterns = rng.uniform(0, 255, size=(10, 784))
y_train = rng.integers(0, 10, size=1400)
y_test = rng.integers(0, 10, size=300)
x_train = np.clip(patterns[y_train] + rng.normal(0, 100, (1400, 784)), 0, 255).astype("float32") / 255
x_test = np.clip(patterns[y_test] + rng.normal(0, 100, (300, 784)), 0, 255).astype("float32") / 255

# Reserve 200 samples for validation
x_val = x_train[-200:]
y_val = y_train[-200:]
x_train = x_train[:-200]
y_train = y_train[:-200]


def get_uncompiled_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


model = get_uncompiled_model()
model = tnt.Model(model)
model.compile(
    optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
)

sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0

print("Fit with sample weight")
history = model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=64, epochs=2,
                    validation_data=(x_val, y_val))

score = model.evaluate(x_test, y_test, batch_size=128)
predictions = model.predict(x_test[:100])
