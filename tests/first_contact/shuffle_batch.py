"""fit(shuffle="batch"), which the Keras API docs offer for data read in batch-sized chunks (HDF5):
a softmax classifier of tabular measurements (three wine cultivars, 13 features), standardized,
997 samples in batches of 32 (an uneven last batch), validation_split. The measurements are made
up."""

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(99)

rng = np.random.default_rng(99)
centers = rng.normal(0, 2, size=(3, 13))
labels = rng.integers(0, 3, size=1297)
measurements = (centers[labels] + rng.normal(0, 1.5, size=(1297, 13))) * rng.uniform(1, 100, size=13)
measurements = (measurements - measurements.mean(axis=0)) / measurements.std(axis=0)
x_train, y_train = measurements[:997].astype("float32"), labels[:997]
x_test, y_test = measurements[997:].astype("float32"), labels[997:]

model = keras.Sequential([
    keras.Input(shape=(13,)),
    keras.layers.Dense(32, activation="relu"),
    keras.layers.Dense(16, activation="relu"),
    keras.layers.Dense(3, activation="softmax"),
])
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = model.fit(x_train, y_train, batch_size=32, epochs=3, shuffle="batch", validation_split=0.1)

score = model.evaluate(x_test, y_test, verbose=0)
predictions = model.predict(x_test)
print("test accuracy:", score[1])
