"""File sources, keras.utils.PyDataset and NumPy inputs under tnt.Model on any Keras backend
(KERAS_BACKEND picks; run on JAX and torch by tests/test_jax_backend.py and
tests/test_torch_backend.py), against serial Keras on the same backend.

`--mode serial` trains with plain Keras and never imports tarantella; `--mode tnt` wraps the model
in tnt.Model. Each saves CASE.rankR.npz (weights, History, evaluate, predictions, and what a
callback saw) for tests/conftest.py's assert_ranks_like_serial. `--files DIR` names the folder
that record_files.write filled (the test writes the files once, for every process).

- files-NAME: the pipeline NAME of tests/workers/record_files.py (the TFRecord and text-line
  shapes of tests/test_file_sources.py: interleaves, num_parallel_reads with repeat and take, a
  list_files shuffle that reshuffles each epoch, text lines; GZIP files and a filter, read whole
  by every rank): fit for 2 epochs with the same pipeline as validation data, evaluate, predict.
  103 records in batches of 16, 10 or 12: uneven last batches on 2 and 3 ranks.
- pydataset: a PyDataset of global batches of 71 (135 samples: uneven micro-batches on 2 and 3
  ranks), a PyDataset as validation data, evaluate and predict on one; a callback wrapped in
  tnt.keras.callbacks.Callback records every batch's logs (global: equal to serial Keras').
- pydataset-shuffled: fit(..., shuffle=True) for 3 epochs, batches of 16 (the last of 7): Keras
  draws the batch order with Python's `random`, which the script's set_random_seed seeds, and
  the PyDataset's own on_epoch_end reshuffles its rows with NumPy's generator, as keras-io's
  PyDatasets do: both orders are serial Keras' own.
- numpy-batch71: arrays with sample weights, validation_split=0.2, global batch 71.
- numpy-batch2: 9 samples in global batches of 2: the last one, of 1 sample, leaves every rank
  but one without samples.
- compute-loss-override: a model that overrides compute_loss (adding a mean penalty on its
  outputs to the compiled loss), the customization the JAX and torch steps take where an
  overridden train_step is refused; NumPy arrays in global batches of 71.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES = 135

# The pipelines of tests/workers/record_files.py (imported in run_case: it imports TensorFlow,
# which the tnt mode imports after tarantella).
FILE_CASES = ["files-interleave", "files-list-files-parallel-interleave", "files-num-parallel-reads",
              "files-text-lines", "files-gzip-records", "files-interleave-then-filter"]
PYDATASET_CASES = ["pydataset", "pydataset-shuffled"]
NUMPY_CASES = ["numpy-batch71", "numpy-batch2"]
CASES = FILE_CASES + PYDATASET_CASES + NUMPY_CASES + ["compute-loss-override"]


def build(keras, features):
    """A small MLP; the records' values (0 to 102) are scaled down first."""
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(16, activation="tanh")(keras.layers.Rescaling(1 / 50)(inputs))
    return keras.Model(inputs, keras.layers.Dense(5, activation="softmax")(hidden))


def with_own_compute_loss(keras, model):
    class OwnLoss(keras.Model):
        """The compiled loss plus 0.1 x the mean squared output: a mean over the batch, as Keras' losses."""

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
            loss = super().compute_loss(x, y, y_pred, sample_weight, **kwargs)
            return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))

    return OwnLoss(model.inputs, model.outputs)


def arrays(np):
    rng = np.random.default_rng(4)
    features = rng.normal(size=(SAMPLES, 8)).astype("float32") * 50
    return features, rng.integers(0, 5, SAMPLES), rng.uniform(0.0, 2.0, SAMPLES).astype("float32")


def py_dataset_class(keras, np):
    class Batches(keras.utils.PyDataset):
        """The rows of `features` and `labels` in batches of `size`; with `reshuffle`, the rows are
        put in a new order after every epoch, with NumPy's generator (as keras-io's PyDatasets do)."""

        def __init__(self, features, labels, size, reshuffle=False):
            super().__init__()
            self.features, self.labels, self.size, self.reshuffle = features, labels, size, reshuffle
            self.rows = np.arange(len(features))

        def __len__(self):
            return -(-len(self.features) // self.size)

        def __getitem__(self, index):
            rows = self.rows[index * self.size:(index + 1) * self.size]
            return self.features[rows], self.labels[rows]

        def on_epoch_end(self):
            if self.reshuffle:
                np.random.shuffle(self.rows)

    return Batches


def logs_recorder(keras):
    class Recorder(keras.callbacks.Callback):
        """Every training batch's logs, in sorted key order."""

        def __init__(self):
            super().__init__()
            self.rows = []

        def on_train_batch_end(self, batch, logs=None):
            self.rows.append([float(logs[key]) for key in sorted(logs)])

    return Recorder


def run_case(name, mode, out_dir, files):
    import keras
    import numpy as np

    import record_files  # tests/workers: the files and pipelines of tests/test_file_sources.py

    assert sorted(FILE_CASES) == sorted(f"files-{pipeline}" for pipeline in record_files.PIPELINES)
    tnt = None
    if mode == "tnt":
        import tarantella as tnt
    wrap = tnt.Model if tnt else (lambda model: model)
    keras.utils.set_random_seed(11)
    model = build(keras, 2 if name in FILE_CASES else 8)
    if name == "compute-loss-override":
        model = with_own_compute_loss(keras, model)
    model = wrap(model)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    results = {}
    if name in FILE_CASES:
        pipeline = lambda: record_files.PIPELINES[name[len("files-"):]](files)
        history = model.fit(pipeline(), epochs=2, validation_data=pipeline(), verbose=0)
        results["evaluation"] = np.array(model.evaluate(pipeline(), verbose=0))
        results["predictions"] = model.predict(pipeline(), verbose=0)
    elif name == "pydataset":
        Batches = py_dataset_class(keras, np)
        features, labels, _ = arrays(np)
        recorder = logs_recorder(keras)()
        callback = tnt.keras.callbacks.Callback(recorder, aggregate_logs=True) if tnt else recorder
        history = model.fit(Batches(features, labels, 71), epochs=2, verbose=0, callbacks=[callback],
                            validation_data=Batches(features[:50], labels[:50], 20))
        results["batch_logs"] = np.array(recorder.rows)
        results["evaluation"] = np.array(model.evaluate(Batches(features, labels, 40), verbose=0))
        results["predictions"] = model.predict(Batches(features, labels, 40), verbose=0)
    elif name == "pydataset-shuffled":
        Batches = py_dataset_class(keras, np)
        features, labels, _ = arrays(np)
        history = model.fit(Batches(features, labels, 16, reshuffle=True), epochs=3, shuffle=True, verbose=0)
        results["evaluation"] = np.array(model.evaluate(Batches(features, labels, 16), verbose=0))
    elif name in ("numpy-batch71", "compute-loss-override"):
        features, labels, weights = arrays(np)
        history = model.fit(features, labels, sample_weight=weights, batch_size=71, epochs=2,
                            validation_split=0.2, verbose=0)
        results["evaluation"] = np.array(model.evaluate(features, labels, sample_weight=weights, batch_size=50,
                                                        verbose=0))
        results["predictions"] = model.predict(features, batch_size=40, verbose=0)
    elif name == "numpy-batch2":
        features, labels, _ = arrays(np)
        history = model.fit(features[:9], labels[:9], batch_size=2, epochs=2, verbose=0,
                            validation_data=(features[9:20], labels[9:20]))
        results["evaluation"] = np.array(model.evaluate(features, labels, batch_size=7, verbose=0))
        results["predictions"] = model.predict(features[:11], batch_size=2, verbose=0)
    else:
        raise ValueError(f"unknown case {name}")
    rank = tnt.get_rank() if tnt else 0
    results.update({f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    results.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--files", required=True, help="the folder record_files.write filled")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella  # noqa: F401  (before Keras runs, as users should)
    for name in args.cases.split(","):
        run_case(name, args.mode, args.out, args.files)


if __name__ == "__main__":
    sys.exit(main())
