"""A functional model with three named inputs and two named outputs, as the Keras "functional
API" guide builds its ticket classifier: title and body token sequences through Embedding and
LSTM, binary tags, a priority and a department head; dict inputs and targets, a loss per output,
loss_weights, validation_data. The tickets are made up."""

import numpy as np
import keras
from keras import layers

import tarantella as tnt

keras.utils.set_random_seed(12)

num_tags = 12  # Number of unique issue tags
num_words = 1000  # Size of vocabulary obtained when preprocessing text data
num_departments = 4  # Number of departments for predictions

title_input = keras.Input(shape=(None,), name="title")  # Variable-length sequence of ints
body_input = keras.Input(shape=(None,), name="body")  # Variable-length sequence of ints
tags_input = keras.Input(shape=(num_tags,), name="tags")  # Binary vectors of size `num_tags`

# Embed each word in the title and in the body into a 16-dimensional vector
title_features = layers.Embedding(num_words, 16)(title_input)
body_features = layers.Embedding(num_words, 16)(body_input)

# Reduce sequence of embedded words in the title into a single 16-dimensional vector
title_features = layers.LSTM(16)(title_features)
# Reduce sequence of embedded words in the body into a single 8-dimensional vector
body_features = layers.LSTM(8)(body_features)

# Merge all available features into a single large vector via concatenation
x = layers.concatenate([title_features, body_features, tags_input])

# Stick a logistic regression for priority prediction on top of the features
priority_pred = layers.Dense(1, activation="sigmoid", name="priority")(x)
# Stick a department classifier on top of the features
department_pred = layers.Dense(num_departments, activation="softmax", name="department")(x)

model = keras.Model(
    inputs={"title": title_input, "body": body_input, "tags": tags_input},
    outputs={"priority": priority_pred, "department": department_pred},
)
model = tnt.Model(model)

model.compile(
    optimizer=keras.optimizers.RMSprop(1e-3),
    loss={
        "priority": keras.losses.BinaryCrossentropy(),
        "department": keras.losses.CategoricalCrossentropy(),
    },
    loss_weights={"priority": 1.0, "department": 0.2},
    metrics={"department": ["accuracy"]},
)

# Dummy input data, the tags decide the targets
rng = np.random.default_rng(12)
title_data = rng.integers(num_words, size=(1280, 10))
body_data = rng.integers(num_words, size=(1280, 20))
tags_data = rng.integers(2, size=(1280, num_tags)).astype("float32")
priority_targets = (tags_data[:, :3].sum(axis=1, keepdims=True) >= 2).astype("float32")
department_targets = keras.utils.to_categorical(tags_data[:, 3:5] @ np.array([1, 2]), num_departments)

inputs = {"title": title_data, "body": body_data, "tags": tags_data}
targets = {"priority": priority_targets, "department": department_targets}
train_inputs = {name: data[:1024] for name, data in inputs.items()}
train_targets = {name: data[:1024] for name, data in targets.items()}
val_inputs = {name: data[1024:] for name, data in inputs.items()}
val_targets = {name: data[1024:] for name, data in targets.items()}

history = model.fit(train_inputs, train_targets, epochs=2, batch_size=32,
                    validation_data=(val_inputs, val_targets))

score = model.evaluate(val_inputs, val_targets, verbose=0)
predictions = model.predict(val_inputs)
