"""A small convnet, as TensorFlow's "Convolutional Neural Network (CNN)" tutorial builds it for
CIFAR-10: Conv2D and MaxPooling2D blocks (two, not the tutorial's three convolutions), Flatten,
Dense, logits (a softmax for the predictions), Adam, validation_data, fit's default batch size.
The 32x32 colour images are made up: a colour and a stripe direction per class."""

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(7)

rng = np.random.default_rng(7)
class_names = ["red-horizontal", "red-vertical", "green-horizontal", "green-vertical",
               "blue-horizontal", "blue-vertical"]


def make_images(count):
    labels = rng.integers(0, len(class_names), size=count)
    rows = np.arange(32)
    stripes = (np.sin(rows / 2.0)[None, :, None] > 0).astype("float32")
    images = rng.uniform(0, 200, size=(count, 32, 32, 3))
    for i, label in enumerate(labels):
        pattern = stripes[0] if label % 2 == 0 else stripes[0].T
        images[i, :, :, label // 2] += 55 * pattern
    return images.astype("uint8"), labels.reshape(-1, 1)


(train_images, train_labels), (test_images, test_labels) = make_images(900), make_images(200)
train_images, test_images = train_images / 255.0, test_images / 255.0

model = keras.Sequential()
model.add(keras.Input(shape=(32, 32, 3)))
model.add(layers.Conv2D(16, (3, 3), activation="relu"))
model.add(layers.MaxPooling2D((2, 2)))
model.add(layers.Conv2D(32, (3, 3), activation="relu"))
model.add(layers.MaxPooling2D((2, 2)))
model.add(layers.Flatten())
model.add(layers.Dense(32, activation="relu"))
model.add(layers.Dense(len(class_names)))
model = tnt.Model(model)

model.compile(optimizer=keras.optimizers.Adam(learning_rate=3e-4),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

history = model.fit(train_images, train_labels, epochs=2,
                    validation_data=(test_images, test_labels))

score = model.evaluate(test_images, test_labels, verbose=2)
predictions = keras.ops.convert_to_numpy(keras.layers.Softmax()(model.predict(test_images)))
