"""Inputs whose shapes a dataset's spec leaves open, under tnt.Model on any Keras backend
(KERAS_BACKEND picks; run by tests/test_input_shapes.py), against serial Keras on the same backend.

`--mode serial` trains with plain Keras and never imports tarantella; `--mode tnt` wraps the model
in tnt.Model and changes nothing else. Each case fits for 2 epochs with validation data of its own
kind, then evaluates and predicts, and saves CASE.rankR.npz (weights, History, evaluate,
predictions) for tests/conftest.py's assert_ranks_like_serial.

- timeseries-flatten: `keras.utils.timeseries_dataset_from_array` windows, specced (None, None, 3),
  into a model whose Input is (12, 3) and which flattens them before a Dense layer: built from the
  spec's unknown length, Keras-on-torch refused the windows and Keras-on-JAX could not build.
- timeseries-unbuilt-predict-first: the same windows into a Sequential model without an Input,
  which predict builds, then evaluate builds the compiled loss and metrics, then fit trains.
- padded-sequences: token sequences of 3 to 20 tokens from a generator, `padded_batch`-ed to each
  batch's longest, into an Embedding with mask_zero (a masked mean over the tokens).
- dict-inputs: a dict of two named inputs, windows of unknown length and a vector per sample.
- pydataset-variable-lengths: a keras.utils.PyDataset of the sequences bucketed by length, each
  batch padded to its own longest sequence (Keras' adapter batches it).

107 windows or sequences in batches of 16: the last batch of 11 is uneven on 2 and 3 ranks.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES, BATCH, WINDOW, VOCABULARY = 107, 16, 12, 30
CASES = ["timeseries-flatten", "timeseries-unbuilt-predict-first", "padded-sequences", "dict-inputs",
         "pydataset-variable-lengths"]


def timeseries(keras, np, samples, seed):
    """`samples` windows of WINDOW steps of a 3-feature series, each with the next step's first feature."""
    series = np.cumsum(np.random.default_rng(seed).normal(size=(samples + WINDOW, 3)), axis=0).astype("float32") / 10
    return keras.utils.timeseries_dataset_from_array(series[:-1], series[WINDOW:, :1], sequence_length=WINDOW,
                                                     batch_size=BATCH)


def windows_with_vectors(keras, np, tf, samples, seed):
    """A dict input: each window together with a vector of 4 per sample."""
    vectors = np.random.default_rng(seed + 1).normal(size=(samples, 4)).astype("float32")
    windows = timeseries(keras, np, samples, seed).unbatch()
    joined = tf.data.Dataset.zip(windows, tf.data.Dataset.from_tensor_slices(vectors))
    return joined.map(lambda window, vector: ({"series": window[0], "vector": vector},
                                              window[1] + tf.reduce_sum(vector))).batch(BATCH)


def token_sequences(np, samples, seed):
    """Sequences of 3 to 20 tokens (1 to VOCABULARY - 1; 0 pads) and a class from their first token."""
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(1, VOCABULARY, rng.integers(3, 21)) for _ in range(samples)]
    return sequences, np.array([sequence[0] % 3 for sequence in sequences])


def padded_sequences(np, tf, samples, seed):
    sequences, labels = token_sequences(np, samples, seed)
    signature = (tf.TensorSpec((None,), tf.int64), tf.TensorSpec((), tf.int64))
    generated = tf.data.Dataset.from_generator(lambda: zip(sequences, labels), output_signature=signature)
    return generated.padded_batch(BATCH)


def variable_length_batches(keras, np, samples, seed):
    sequences, labels = token_sequences(np, samples, seed)
    # Bucketed by length, as one does to pad less: every batch has a length of its own (Keras-on-
    # TensorFlow reads the first two batches to tell which dimensions vary).
    by_length = np.argsort([len(sequence) for sequence in sequences], kind="stable")
    sequences, labels = [sequences[row] for row in by_length], labels[by_length]

    class PaddedBatches(keras.utils.PyDataset):
        """Batches of BATCH sequences, each padded with 0 to its own longest sequence."""

        def __len__(self):
            return -(-samples // BATCH)

        def __getitem__(self, index):
            rows = range(index * BATCH, min((index + 1) * BATCH, samples))
            tokens = keras.utils.pad_sequences([sequences[row] for row in rows], padding="post")
            return tokens, labels[rows.start:rows.stop]

    return PaddedBatches()


def token_classifier(keras):
    tokens = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True)(tokens)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(pooled))


def window_regressor(keras):
    windows = keras.Input((WINDOW, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Flatten()(windows))
    return keras.Model(windows, keras.layers.Dense(1)(hidden))


def dict_regressor(keras):
    windows, vectors = keras.Input((WINDOW, 3), name="series"), keras.Input((4,), name="vector")
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(windows), vectors])
    hidden = keras.layers.Dense(8, activation="tanh")(joined)
    return keras.Model({"series": windows, "vector": vectors}, keras.layers.Dense(1)(hidden))


def run_case(name, mode, out_dir):
    import keras
    import numpy as np
    import tensorflow as tf

    tnt = None
    if mode == "tnt":
        import tarantella as tnt
    wrap = tnt.Model if tnt else (lambda model: model)
    keras.utils.set_random_seed(5)
    regression = {"loss": "mse", "metrics": ["mae"]}
    classification = {"loss": "sparse_categorical_crossentropy", "metrics": ["sparse_categorical_accuracy"]}
    if name == "timeseries-flatten":
        model, compiled, data = window_regressor(keras), regression, lambda seed: timeseries(keras, np, SAMPLES, seed)
    elif name == "timeseries-unbuilt-predict-first":
        model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        compiled, data = regression, lambda seed: timeseries(keras, np, SAMPLES, seed)
    elif name == "padded-sequences":
        model, compiled, data = token_classifier(keras), classification, lambda seed: padded_sequences(
            np, tf, SAMPLES, seed)
    elif name == "dict-inputs":
        model, compiled = dict_regressor(keras), regression
        data = lambda seed: windows_with_vectors(keras, np, tf, SAMPLES, seed)
    elif name == "pydataset-variable-lengths":
        model, compiled = token_classifier(keras), classification
        data = lambda seed: variable_length_batches(keras, np, SAMPLES, seed)
    else:
        raise ValueError(f"unknown case {name}")
    model = wrap(model)
    model.compile(keras.optimizers.Adam(0.01), **compiled)
    results = {}
    if name == "timeseries-unbuilt-predict-first":
        results["predictions_before_fit"] = model.predict(data(1), verbose=0)
        results["evaluation_before_fit"] = np.array(model.evaluate(data(1), verbose=0))
    history = model.fit(data(0), epochs=2, validation_data=data(1), verbose=0)
    results["evaluation"] = np.array(model.evaluate(data(2), verbose=0))
    results["predictions"] = model.predict(data(2), verbose=0)
    results.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    results.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    rank = tnt.get_rank() if tnt else 0
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before Keras runs, as users should)
    for name in args.cases.split(","):
        run_case(name, args.mode, args.out)


if __name__ == "__main__":
    sys.exit(main())
