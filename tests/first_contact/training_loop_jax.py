"""A training loop of the user's own on Keras' JAX backend, as keras-io's "Writing a training loop
from scratch in JAX" writes it: a stateless compute_loss_and_updates around model.stateless_call,
jax.value_and_grad of it, a jax.jit train_step(state, data) that updates with
optimizer.stateless_apply, a tf.data pipeline shuffled and batched, the state carried through the
loop and assigned back to the model's variables; a jitted eval step that feeds a metric statelessly.
Three lines make it data-parallel: the optimizer wrapped by tnt.optimizers.Optimizer (whose
stateless_apply sums the ranks' gradients inside the jitted step) and the training batches split by
tnt.data.distribute. Global batches of 48 split evenly on 2 and 3 ranks, so the ranks' gradients
weigh alike without num_samples. Made-up data: ten Gaussian classes in 20 dimensions."""

import types

import jax
import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt

BACKENDS = ("jax",)

keras.utils.set_random_seed(1)

rng = np.random.default_rng(4)
centers = rng.normal(size=(10, 20))
labels = rng.integers(0, 10, size=1200)
features = (centers[labels] + rng.normal(size=(1200, 20))).astype("float32")
x_train, y_train, x_val, y_val = features[:960], labels[:960], features[960:], labels[960:]

inputs = keras.Input(shape=(20,), name="digits")
x = keras.layers.Dense(32, activation="relu")(inputs)
x = keras.layers.Dense(32, activation="relu")(x)
outputs = keras.layers.Dense(10, name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)

loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-3)
optimizer = tnt.optimizers.Optimizer(optimizer)
val_acc_metric = keras.metrics.SparseCategoricalAccuracy()

batch_size = 48
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(buffer_size=1024).batch(batch_size)
train_dataset = tnt.data.distribute(train_dataset)
val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size)


def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x,
                                                           training=True)
    return loss_fn(y, y_pred), non_trainable_variables


grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)


@jax.jit
def train_step(state, data):
    trainable_variables, non_trainable_variables, optimizer_variables = state
    x, y = data
    (loss, non_trainable_variables), grads = grad_fn(trainable_variables, non_trainable_variables, x, y)
    trainable_variables, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads,
                                                                         trainable_variables)
    return loss, (trainable_variables, non_trainable_variables, optimizer_variables)


@jax.jit
def eval_step(state, data):
    trainable_variables, non_trainable_variables, metric_variables = state
    x, y = data
    y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x)
    metric_variables = val_acc_metric.stateless_update_state(metric_variables, y, y_pred)
    return (trainable_variables, non_trainable_variables, metric_variables)


optimizer.build(model.trainable_variables)
state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
         [v.value for v in optimizer.variables])

val_accuracies = []
for epoch in range(3):
    for step, data in enumerate(train_dataset):
        data = (data[0].numpy(), data[1].numpy())
        loss, state = train_step(state, data)
    trainable_variables, non_trainable_variables, _ = state
    metric_variables = [v.value for v in val_acc_metric.variables]
    for data in val_dataset:
        _, _, metric_variables = eval_step((trainable_variables, non_trainable_variables, metric_variables),
                                           (data[0].numpy(), data[1].numpy()))
    val_accuracies.append(float(val_acc_metric.stateless_result(metric_variables)))

trainable_variables, non_trainable_variables, optimizer_variables = state
for variable, value in zip(model.trainable_variables, trainable_variables):
    variable.assign(value)
for variable, value in zip(model.non_trainable_variables, non_trainable_variables):
    variable.assign(value)

history = types.SimpleNamespace(history={"val_accuracy": val_accuracies})
score = [float(loss_fn(y_val, model(x_val)))]
predictions = keras.ops.convert_to_numpy(keras.ops.softmax(model.predict(x_val, verbose=0)))
