"""Regression with a Normalization layer adapted on the training features and EarlyStopping that
restores the best weights, as TensorFlow's "Basic regression: Predict fuel efficiency" trains its
DNN: an 80/20 train/test split, mean absolute error, Adam, validation_split=0.2; the third epoch
improves too little, so EarlyStopping stops there and restores the second. The cars are made
up (398 of them, as in Auto MPG): 250 training samples make uneven last batches."""

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(0)

rng = np.random.default_rng(0)
count = 398
cylinders = rng.choice([4, 6, 8], size=count, p=[0.5, 0.25, 0.25])
displacement = cylinders * rng.uniform(20, 45, size=count)
horsepower = displacement * rng.uniform(0.4, 0.7, size=count) + 20
weight = 1500 + displacement * rng.uniform(6, 9, size=count)
acceleration = rng.uniform(8, 25, size=count)
model_year = rng.integers(70, 83, size=count)
origin = rng.integers(0, 3, size=count)
mpg = 55 - 0.006 * weight - 0.03 * horsepower + 0.7 * (model_year - 70) + 2 * (origin > 0) + rng.normal(0, 2, count)
dataset = np.column_stack([mpg, cylinders, displacement, horsepower, weight, acceleration, model_year,
                           origin == 0, origin == 1, origin == 2]).astype("float32")  # USA, Europe, Japan

train_rows = rng.permutation(count)[:int(0.8 * count)]
test_rows = np.setdiff1d(np.arange(count), train_rows)
train_features, train_labels = dataset[train_rows, 1:], dataset[train_rows, 0]
test_features, test_labels = dataset[test_rows, 1:], dataset[test_rows, 0]

normalizer = layers.Normalization(axis=-1)
normalizer.adapt(np.array(train_features))


def build_model(norm):
    return keras.Sequential([
        norm,
        layers.Dense(64, activation="relu"),
        layers.Dense(64, activation="relu"),
        layers.Dense(1),
    ])


model = build_model(normalizer)
model = tnt.Model(model)
model.compile(loss="mean_absolute_error", optimizer=keras.optimizers.Adam(0.03))

# Stop once an epoch improves the validation MAE by less than 3 MPG, back at the best epoch's weights
early_stop = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=3, patience=1, restore_best_weights=True)
history = model.fit(
    train_features,
    train_labels,
    validation_split=0.2,
    verbose=0,
    epochs=3,
    callbacks=[early_stop],
)

score = model.evaluate(test_features, test_labels, verbose=0)
predictions = model.predict(test_features).flatten()
print("test MAE [MPG]:", score, "best epoch:", early_stop.best_epoch + 1)
