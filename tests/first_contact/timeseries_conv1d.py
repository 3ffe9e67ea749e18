"""A Conv1D timeseries classifier, as keras-io's "Timeseries classification from scratch" trains
it on FordA: the series reshaped to (length, 1), shuffled with np.random.permutation, labels -1
mapped to 0, three Conv1D blocks (GELU instead of the example's BatchNormalization and ReLU),
global average pooling, ModelCheckpoint(save_best_only=True) into a temporary directory,
ReduceLROnPlateau and EarlyStopping on val_loss, validation_split=0.2. The series are made up:
noisy sine waves whose frequency gives the class."""

import os
import tempfile

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(8)

rng = np.random.default_rng(8)


def make_series(count, length=128):
    labels = rng.choice([-1, 1], size=count)
    time = np.arange(length)
    frequency = np.where(labels == 1, 0.6, 0.1)[:, None] + rng.normal(0, 0.01, (count, 1))
    series = np.sin(frequency * time + rng.uniform(0, 2 * np.pi, (count, 1))) + rng.normal(0, 1.0, (count, length))
    return series, labels


x_train, y_train = make_series(800)
x_test, y_test = make_series(200)

x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))

num_classes = len(np.unique(y_train))

idx = np.random.permutation(len(x_train))
x_train = x_train[idx]
y_train = y_train[idx]

y_train[y_train == -1] = 0
y_test[y_test == -1] = 0


def make_model(input_shape):
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.Activation("gelu")(conv1)

    conv2 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.Activation("gelu")(conv2)

    conv3 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.Activation("gelu")(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    return keras.models.Model(inputs=input_layer, outputs=output_layer)


model = make_model(input_shape=x_train.shape[1:])
model = tnt.Model(model)

epochs = 3
batch_size = 32

with tempfile.TemporaryDirectory() as output_dir:
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(output_dir, "best_model.keras"), save_best_only=True,
                                        monitor="val_loss"),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=0.0001),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, verbose=1),
    ]
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        callbacks=callbacks,
        validation_split=0.2,
        verbose=1,
    )

score = model.evaluate(x_test, y_test)
print("Test accuracy", score[1])
print("Test loss", score[0])
predictions = model.predict(x_test)
