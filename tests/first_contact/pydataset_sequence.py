"""A keras.utils.PyDataset over in-memory arrays, as keras-io writes them (and the classic "data
generators with Keras" tutorial before it): __len__ from math.ceil, __getitem__ slicing the arrays
by an index array that on_epoch_end reshuffles with np.random.shuffle; fit with its default
shuffle, an unshuffled PyDataset for validation_data. A small convnet on made-up 16x16 colour
images, 1000 of them in batches of 64 (the last one of 40)."""

import math

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(21)


class ArrayDataset(keras.utils.PyDataset):
    def __init__(self, x_set, y_set, batch_size, shuffle=True, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x_set, y_set
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.on_epoch_end()

    def __len__(self):
        # Return number of batches.
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, idx):
        # Return x, y for batch idx.
        low = idx * self.batch_size
        # Cap upper bound at array length; the last batch may be smaller
        # if the total number of items is not a multiple of batch size.
        high = min(low + self.batch_size, len(self.x))
        batch_indexes = self.indexes[low:high]
        return self.x[batch_indexes], self.y[batch_indexes]

    def on_epoch_end(self):
        # Updates indexes after each epoch
        self.indexes = np.arange(len(self.x))
        if self.shuffle:
            np.random.shuffle(self.indexes)


rng = np.random.default_rng(21)
templates = rng.uniform(0, 1, size=(5, 16, 16, 3)).astype("float32")
labels = rng.integers(0, 5, size=1200)
images = np.clip(templates[labels] + rng.normal(0, 0.5, size=(1200, 16, 16, 3)), 0, 1).astype("float32")

train_ds = ArrayDataset(images[:1000], labels[:1000], batch_size=64)
val_ds = ArrayDataset(images[1000:], labels[1000:], batch_size=64, shuffle=False)

model = keras.Sequential([
    keras.Input(shape=(16, 16, 3)),
    layers.Conv2D(16, 3, activation="relu"),
    layers.MaxPooling2D(),
    layers.Flatten(),
    layers.Dense(5, activation="softmax"),
])
model = tnt.Model(model)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = model.fit(train_ds, epochs=3, validation_data=val_ds)

score = model.evaluate(val_ds)
predictions = model.predict(val_ds)
