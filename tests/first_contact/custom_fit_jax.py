"""A model that overrides its steps on Keras' JAX backend, as keras-io's "Customizing what happens in
fit() with JAX" writes them: a stateless compute_loss_and_updates that calls stateless_call and
compute_loss, a train_step(state, data) that differentiates it with jax.value_and_grad, updates with
optimizer.stateless_apply and feeds each metric statelessly (the loss tracker the loss, the compiled
metrics y and y_pred), and a test_step(state, data) of the same kind. compile with a loss and a
metric, fit with validation_split, evaluate, predict. The data are made up: a noisy linear target."""

import jax
import keras
import numpy as np

import tarantella as tnt

BACKENDS = ("jax",)

keras.utils.set_random_seed(1)


class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        gradient_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = gradient_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_vars)
            this_metric_vars = metrics_variables[start:start + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state

    def test_step(self, state, data):
        x, y = data
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=False)
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_vars)
            this_metric_vars = metrics_variables[start:start + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)


rng = np.random.default_rng(1)
x = rng.random((1000, 32)).astype("float32")
y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(1000, 1))).astype("float32")

inputs = keras.Input(shape=(32,))
hidden = keras.layers.Dense(16, activation="tanh")(inputs)
outputs = keras.layers.Dense(1)(hidden)
model = CustomModel(inputs, outputs)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse", metrics=["mae"])

history = model.fit(x[:800], y[:800], batch_size=32, epochs=3, validation_split=0.2, verbose=0)

score = model.evaluate(x[800:], y[800:], batch_size=32, verbose=0)
predictions = model.predict(x[800:], batch_size=32, verbose=0)
