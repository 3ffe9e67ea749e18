"""A training loop of the user's own on Keras' PyTorch backend, as keras-io's "Writing a training loop
from scratch in PyTorch" writes it: per batch the model's logits, the loss, model.zero_grad(),
loss.backward(), each variable's .value.grad handed to optimizer.apply under torch.no_grad(); a
training metric updated per batch and reset per epoch, a validation pass with a metric. Three lines
make it data-parallel: the optimizer wrapped by tnt.optimizers.Optimizer and the training batches
split by tnt.data.distribute (a tf.data pipeline, whose NumPy batches become torch tensors, where the
guide has a DataLoader). Global batches of 48 split evenly on 2 and 3 ranks, so the ranks' gradients
weigh alike without num_samples. Made-up data: ten Gaussian classes in 20 dimensions."""

import types

import keras
import numpy as np
import tensorflow as tf
import torch

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(1)

rng = np.random.default_rng(5)
centers = rng.normal(size=(10, 20))
labels = rng.integers(0, 10, size=1200)
features = (centers[labels] + rng.normal(size=(1200, 20))).astype("float32")
x_train, y_train, x_val, y_val = features[:960], labels[:960], features[960:], labels[960:]

inputs = keras.Input(shape=(20,), name="digits")
x = keras.layers.Dense(32, activation="relu")(inputs)
x = keras.layers.Dense(32, activation="relu")(x)
outputs = keras.layers.Dense(10, name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)

optimizer = keras.optimizers.Adam(learning_rate=1e-3)
optimizer = tnt.optimizers.Optimizer(optimizer)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
val_acc_metric = keras.metrics.SparseCategoricalAccuracy()

batch_size = 48
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(buffer_size=1024).batch(batch_size)
train_dataset = tnt.data.distribute(train_dataset)
val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size)

val_accuracies = []
for epoch in range(3):
    for step, (inputs, targets) in enumerate(train_dataset.as_numpy_iterator()):
        inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        logits = model(inputs)
        loss = loss_fn(targets, logits)
        model.zero_grad()
        loss.backward()
        trainable_weights = [v for v in model.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            optimizer.apply(gradients, trainable_weights)
        train_acc_metric.update_state(targets, logits)
    train_acc_metric.reset_state()
    for inputs, targets in val_dataset.as_numpy_iterator():
        val_acc_metric.update_state(torch.from_numpy(targets), model(torch.from_numpy(inputs), training=False))
    val_accuracies.append(float(val_acc_metric.result()))
    val_acc_metric.reset_state()

history = types.SimpleNamespace(history={"val_accuracy": val_accuracies})
score = [float(keras.ops.convert_to_numpy(loss_fn(torch.from_numpy(y_val), model(torch.from_numpy(x_val)))))]
predictions = keras.ops.convert_to_numpy(keras.ops.softmax(model.predict(x_val, verbose=0)))
