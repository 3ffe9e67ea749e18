"""Keras on PyTorch with torch's own input pipeline, as keras-io's "Introduction to Keras for
engineers" feeds a model: TensorDatasets, a DataLoader with shuffle=True for training and one
without for validation and evaluation, fit on the DataLoader. A small convnet on made-up 28x28
digits."""

import numpy as np
import keras
import torch

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(10)

num_classes = 10
input_shape = (28, 28, 1)
batch_size = 50

rng = np.random.default_rng(10)
patterns = rng.uniform(0, 1, size=(num_classes, 28, 28, 1))
y_train = rng.integers(0, num_classes, size=1100)
y_test = rng.integers(0, num_classes, size=300)
x_train = np.clip(patterns[y_train] + rng.normal(0, 0.5, (1100, 28, 28, 1)), 0, 1).astype("float32")
x_test = np.clip(patterns[y_test] + rng.normal(0, 0.5, (300, 28, 28, 1)), 0, 1).astype("float32")

train_torch_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
val_torch_dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))

train_dataloader = torch.utils.data.DataLoader(train_torch_dataset, batch_size=batch_size, shuffle=True)
val_dataloader = torch.utils.data.DataLoader(val_torch_dataset, batch_size=batch_size, shuffle=False)

model = keras.Sequential([
    keras.layers.Input(shape=input_shape),
    keras.layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
    keras.layers.GlobalAveragePooling2D(),
    keras.layers.Dense(num_classes, activation="softmax"),
])
model = tnt.Model(model)

model.compile(
    loss=keras.losses.SparseCategoricalCrossentropy(),
    optimizer=keras.optimizers.Adam(learning_rate=1e-2),
    metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
)

history = model.fit(train_dataloader, epochs=2, validation_data=val_dataloader)

score = model.evaluate(val_dataloader)
predictions = model.predict(x_test)
