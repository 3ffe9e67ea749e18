"""Steps of uneven size, as any user's data gives them: 1001 training samples in batches of 100
leave a last step of 1 sample (on 2 or 3 ranks some ranks get none of it), evaluate on 301
samples in batches of 100, predict on 67 at the default batch of 32. A logistic classifier of
structured data in the style of keras-io's "Structured data classification from scratch" (numeric
features only, made up), with validation_data."""

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(2)

rng = np.random.default_rng(2)
features = rng.normal(size=(1369, 6)).astype("float32")
features[:, 3] = features[:, 3] * 15 + 50  # age
features[:, 4] = features[:, 4] * 30 + 130  # blood pressure
target = ((features[:, 0] + 0.5 * features[:, 1] + (features[:, 3] - 50) / 15 + rng.normal(0, 1, 1369)) > 0.5)
target = target.astype("float32")

x_train, y_train = features[:1001], target[:1001]
x_val, y_val = features[1001:1302], target[1001:1302]
x_test = features[1302:]

normalizer = layers.Normalization()
normalizer.adapt(x_train)

inputs = keras.Input(shape=(6,))
x = normalizer(inputs)
x = layers.Dense(32, activation="relu")(x)
output = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, output)
model = tnt.Model(model)
model.compile("adam", "binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])

history = model.fit(x_train, y_train, batch_size=100, epochs=3, validation_data=(x_val, y_val))

score = model.evaluate(x_val, y_val, batch_size=100, verbose=0)
predictions = model.predict(x_test)
