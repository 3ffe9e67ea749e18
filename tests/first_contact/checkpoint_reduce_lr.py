"""Checkpoints every epoch and a learning rate cut on plateaus, as TensorFlow's "Save and load
models" guide trains its first 1000 MNIST digits (ModelCheckpoint with save_weights_only=True,
here into a temporary directory) with ReduceLROnPlateau on the validation accuracy, which
saturates at the first epoch, so the third epoch trains at a fifth of the learning rate.
The digits are made up: flattened 784-pixel images, a noisy pattern per class."""

import os
import tempfile

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(3)

rng = np.random.default_rng(3)
patterns = rng.uniform(0, 1, size=(10, 784))
train_labels = rng.integers(0, 10, size=1000)
test_labels = rng.integers(0, 10, size=500)
train_images = np.clip(patterns[train_labels] + rng.normal(0, 0.5, (1000, 784)), 0, 1).astype("float32")
test_images = np.clip(patterns[test_labels] + rng.normal(0, 0.5, (500, 784)), 0, 1).astype("float32")


def create_model():
    return keras.Sequential([
        keras.layers.Dense(128, activation="relu", input_shape=(784,)),
        keras.layers.Dense(10, activation="softmax"),
    ])


model = create_model()
model = tnt.Model(model)
model.compile(optimizer="adam",
              loss=keras.losses.SparseCategoricalCrossentropy(),
              metrics=[keras.metrics.SparseCategoricalAccuracy()])

with tempfile.TemporaryDirectory(prefix="training_1-") as checkpoint_dir:
    checkpoint_path = os.path.join(checkpoint_dir, "cp.weights.h5")
    cp_callback = keras.callbacks.ModelCheckpoint(filepath=checkpoint_path, save_weights_only=True, verbose=1)
    reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="val_sparse_categorical_accuracy", factor=0.2,
                                                  patience=1, min_lr=0.0001)

    history = model.fit(train_images, train_labels, epochs=3,
                        validation_data=(test_images, test_labels),
                        callbacks=[cp_callback, reduce_lr])
    print("checkpoint directory:", os.listdir(checkpoint_dir))

score = model.evaluate(test_images, test_labels, verbose=2)
predictions = model.predict(test_images)
