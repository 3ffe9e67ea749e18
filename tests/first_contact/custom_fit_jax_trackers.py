"""keras-io's "Customizing what happens in fit() with JAX", its lower-level part: compile takes the
optimizer alone; the model holds its own loss function and metrics (a Mean loss tracker fed the
batch's mean loss, a MeanAbsoluteError) listed in its `metrics` property, and its stateless
train_step feeds them and reads their results itself; a test_step of the same kind (the built-in one
calls compute_loss_and_updates with Keras' own signature). The data are made up: a noisy linear target,
with an uneven last batch."""

import jax
import keras
import numpy as np

import tarantella as tnt

BACKENDS = ("jax",)

keras.utils.set_random_seed(1)


class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        gradient_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = gradient_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_vars = metrics_variables[len(self.loss_tracker.variables):]
        tracker_vars = self.loss_tracker.stateless_update_state(tracker_vars, loss)
        mae_vars = self.mae_metric.stateless_update_state(mae_vars, y, y_pred)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_vars)}
        state = (trainable_variables, non_trainable_variables, optimizer_variables, tracker_vars + mae_vars)
        return logs, state

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        x, y = data
        loss, (y_pred, non_trainable_variables) = self.compute_loss_and_updates(
            trainable_variables, non_trainable_variables, x, y)
        tracker_vars = self.loss_tracker.stateless_update_state(
            metrics_variables[:len(self.loss_tracker.variables)], loss)
        mae_vars = self.mae_metric.stateless_update_state(metrics_variables[len(self.loss_tracker.variables):],
                                                          y, y_pred)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_vars)}
        return logs, (trainable_variables, non_trainable_variables, tracker_vars + mae_vars)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


rng = np.random.default_rng(2)
x = rng.random((1000, 32)).astype("float32")
y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(1000, 1))).astype("float32")

inputs = keras.Input(shape=(32,))
outputs = keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inputs))
model = CustomModel(inputs, outputs)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2))

history = model.fit(x[:900], y[:900], batch_size=64, epochs=3, verbose=0)

score = model.evaluate(x[900:], y[900:], batch_size=64, verbose=0)
predictions = model.predict(x[900:], batch_size=64, verbose=0)
