"""A subclassed model, as the Keras guide "Making new layers and models via subclassing" writes
one: a Linear layer creating its weights with add_weight in build(), a keras.Model subclass
whose call() chains them with relu; Keras' own training step, fit with validation_split. The
data are made up: two interleaved spirals in 2-D, lifted to 8 features."""

import numpy as np
import keras
from keras import ops

import tarantella as tnt

keras.utils.set_random_seed(1)


class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class MLP(keras.Model):
    """Simple stack of Linear layers."""

    def __init__(self, num_classes=2, **kwargs):
        super().__init__(**kwargs)
        self.linear_1 = Linear(64)
        self.linear_2 = Linear(32)
        self.linear_3 = Linear(num_classes)

    def call(self, inputs):
        x = self.linear_1(inputs)
        x = keras.activations.relu(x)
        x = self.linear_2(x)
        x = keras.activations.relu(x)
        return self.linear_3(x)


rng = np.random.default_rng(1)
turns = rng.uniform(0.5, 3.5, size=1500)
spiral = rng.integers(0, 2, size=1500)
angle = turns * np.pi + np.pi * spiral
points = np.column_stack([turns * np.cos(angle), turns * np.sin(angle)]) + rng.normal(0, 0.1, (1500, 2))
features = np.column_stack([points, points ** 2, np.sin(points), np.cos(points)]).astype("float32")
x_train, y_train, x_test, y_test = features[:1200], spiral[:1200], features[1200:], spiral[1200:]

model = MLP()
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=[keras.metrics.SparseCategoricalAccuracy()])

history = model.fit(x_train, y_train, batch_size=64, epochs=3, validation_split=0.15)

score = model.evaluate(x_test, y_test, verbose=0)
predictions = keras.ops.convert_to_numpy(keras.ops.softmax(model.predict(x_test)))
