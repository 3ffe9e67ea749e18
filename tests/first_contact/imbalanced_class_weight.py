"""Binary classification of rare events with class_weight, as keras-io's "Imbalanced
classification: credit card fraud detection" does it: features standardized with the training
set's mean and std, class weights 1/count, confusion-matrix metrics with precision and recall,
validation_data. The 30 features are made up; about 4% of the samples are positive."""

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(1337)

rng = np.random.default_rng(1337)
features = rng.normal(size=(2000, 30)).astype("float32")
features[:, 5:] *= rng.uniform(0.1, 50.0, size=25).astype("float32")  # unscaled amounts, as in the data
risk = features[:, 0] * 1.5 - features[:, 1] + 0.8 * features[:, 2] + rng.normal(0, 0.5, 2000)
targets = (risk > 3.0).astype("uint8").reshape(-1, 1)

num_val_samples = int(len(features) * 0.2)
train_features = features[:-num_val_samples]
train_targets = targets[:-num_val_samples]
val_features = features[-num_val_samples:]
val_targets = targets[-num_val_samples:]

counts = np.bincount(train_targets[:, 0])
print("Number of positive samples in training data: {} ({:.2f}% of total)".format(
    counts[1], 100 * float(counts[1]) / len(train_targets)))

weight_for_0 = 1.0 / counts[0]
weight_for_1 = 1.0 / counts[1]

mean = np.mean(train_features, axis=0)
train_features -= mean
val_features -= mean
std = np.std(train_features, axis=0)
train_features /= std
val_features /= std

model = keras.Sequential([
    keras.Input(shape=train_features.shape[1:]),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(1, activation="sigmoid"),
])
model = tnt.Model(model)

metrics = [
    keras.metrics.FalseNegatives(name="fn"),
    keras.metrics.FalsePositives(name="fp"),
    keras.metrics.TrueNegatives(name="tn"),
    keras.metrics.TruePositives(name="tp"),
    keras.metrics.Precision(name="precision"),
    keras.metrics.Recall(name="recall"),
]
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)

class_weight = {0: weight_for_0, 1: weight_for_1}
history = model.fit(
    train_features,
    train_targets,
    batch_size=256,
    epochs=3,
    verbose=2,
    validation_data=(val_features, val_targets),
    class_weight=class_weight,
)

score = model.evaluate(val_features, val_targets, verbose=0)
predictions = model.predict(val_features)
