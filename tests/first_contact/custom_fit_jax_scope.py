"""A JAX train_step that updates through the optimizer's stateful API inside a StatelessScope of its own
(what Keras' own optimizer.stateless_apply does inside): the scope maps the trainable and optimizer
variables to the step's state, optimizer.apply(grads) runs in it, and the new state is read back from
the scope. SGD with momentum; compile with a loss and a metric; fit, evaluate, predict. The data are
made up: a noisy two-class problem, with an uneven last batch."""

import jax
import keras
import numpy as np

import tarantella as tnt

BACKENDS = ("jax",)

keras.utils.set_random_seed(4)


class ScopedUpdateModel(keras.Model):
    def loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        return self.compute_loss(x, y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        gradient_fn = jax.value_and_grad(self.loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = gradient_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        mapping = list(zip(self.trainable_variables, trainable_variables)) + list(
            zip(self.optimizer.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.optimizer.apply(grads)
        trainable_variables = [scope.get_current_value(v) for v in self.trainable_variables]
        optimizer_variables = [scope.get_current_value(v) for v in self.optimizer.variables]
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)


rng = np.random.default_rng(5)
x = rng.normal(size=(700, 12)).astype("float32")
y = (x[:, :3].sum(axis=1) + 0.3 * rng.normal(size=700) > 0).astype("float32")[:, None]

inputs = keras.Input(shape=(12,))
outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(24, activation="relu")(inputs))
model = ScopedUpdateModel(inputs, outputs)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), loss="binary_crossentropy",
              metrics=["binary_accuracy"])

history = model.fit(x[:600], y[:600], batch_size=48, epochs=3, verbose=0)

score = model.evaluate(x[600:], y[600:], batch_size=48, verbose=0)
predictions = model.predict(x[600:], batch_size=48, verbose=0)
