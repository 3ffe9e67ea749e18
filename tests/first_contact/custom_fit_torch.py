"""A model that overrides its steps on Keras' PyTorch backend, as keras-io's "Customizing what happens
in fit() with PyTorch" writes them: train_step clears the gradients with zero_grad, runs the model,
takes compute_loss, calls loss.backward(), hands each variable's .value.grad to optimizer.apply
under torch.no_grad(), feeds every metric (the loss tracker the loss, the compiled metrics y and
y_pred) and returns each metric's result; test_step does the same without the update. compile with
a loss and metrics, fit with validation_split, evaluate, predict. Made-up data: a noisy linear
target, with uneven last batches."""

import keras
import numpy as np
import torch

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(1)


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


rng = np.random.default_rng(3)
x = rng.random((1000, 32)).astype("float32")
y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(1000, 1))).astype("float32")

inputs = keras.Input(shape=(32,))
outputs = keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inputs))
model = CustomModel(inputs, outputs)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse", metrics=["mae"])

history = model.fit(x[:850], y[:850], batch_size=64, epochs=3, validation_split=0.2, verbose=0)

score = model.evaluate(x[850:], y[850:], batch_size=64, verbose=0)
predictions = model.predict(x[850:], batch_size=64, verbose=0)
