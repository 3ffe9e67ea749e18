"""Sentiment classification of integer-encoded reviews, as TensorFlow's "Basic text
classification" trains its model after TextVectorization: Embedding, GlobalAveragePooling1D,
a Dense logit, BinaryCrossentropy(from_logits=True), BinaryAccuracy, validation_data. The
reviews are made up token ids (0 pads, 1 is out-of-vocabulary), positive ones use more of the
"good" words."""

import numpy as np
import keras
from keras import layers, losses

import tarantella as tnt

keras.utils.set_random_seed(2024)

max_features = 1000
sequence_length = 60
embedding_dim = 16

rng = np.random.default_rng(2024)


def make_reviews(count):
    labels = rng.integers(0, 2, size=count)
    reviews = np.zeros((count, sequence_length), dtype="int64")
    for i, label in enumerate(labels):
        length = rng.integers(10, sequence_length + 1)
        common = rng.integers(2, max_features, size=length)
        tone = rng.integers(2, 100, size=length) + (100 if label else 0)  # words 2..99 bad, 100..199 good
        reviews[i, :length] = np.where(rng.uniform(size=length) < 0.3, tone, common)
    return reviews, labels.astype("float32")


(x_train, y_train), (x_val, y_val), (x_test, y_test) = make_reviews(1200), make_reviews(300), make_reviews(300)

model = keras.Sequential([
    keras.Input(shape=(sequence_length,), dtype="int64"),
    layers.Embedding(max_features, embedding_dim),
    layers.GlobalAveragePooling1D(),
    layers.Dense(1),
])
model = tnt.Model(model)

model.compile(loss=losses.BinaryCrossentropy(from_logits=True),
              optimizer="adam",
              metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)])

epochs = 3
history = model.fit(x_train, y_train, validation_data=(x_val, y_val), epochs=epochs)

score = model.evaluate(x_test, y_test)
# Probabilities, as the tutorial's export model gives them with a sigmoid Activation layer
predictions = keras.ops.convert_to_numpy(layers.Activation("sigmoid")(model.predict(x_test)))
print("positive reviews predicted:", int((predictions > 0.5).sum()), "of", len(x_test))
