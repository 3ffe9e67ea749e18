"""The sample orders of the epochs of a resumed fit: those an uninterrupted run would have drawn."""

import keras

from tarantella import backends
from tarantella.data import keras_batches


class EpochOrder(keras.callbacks.Callback):
    """Gives the epochs of a fit resumed from a backup (BackupAndRestore's, or the automatic backups of
    a restarted job) the sample orders they have in an uninterrupted run.

    An input draws each epoch's order anew: a shuffle with reshuffle_each_iteration from a seed
    generator when an iterator is made (or, for some pipelines, at its first read), Keras' adapters
    from NumPy's, Python's or torch's generator. A resumed fit starts at epoch k > its initial epoch,
    so before that epoch the input draws what the k - initial skipped epochs would have drawn: for a
    dataset tarantella split, the iterators an uninterrupted fit would have made, one batch read from
    each that fit read; for an input Keras batches, the same through Keras' own epoch iterator
    (keras_batches.replay_passes). A fit started at a later epoch by its own `initial_epoch` replays
    nothing, as in Keras: its input goes on from where the program left it."""

    def __init__(self, initial_epoch):
        super().__init__()
        self._initial_epoch = initial_epoch
        self._dataset = None
        self._keras_epoch_iterator = None
        self._started = False

    def skip_earlier_passes_of(self, dataset):
        self._dataset = dataset

    def replay_through(self, keras_epoch_iterator):
        self._keras_epoch_iterator = keras_epoch_iterator

    def on_train_begin(self, logs=None):
        self._started = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._started:
            return
        self._started = True
        skipped = epoch - self._initial_epoch
        if skipped <= 0:
            return
        if self._keras_epoch_iterator is not None:
            keras_batches.replay_passes(self._keras_epoch_iterator, skipped)
        elif self._dataset is not None:
            # Checked against Keras in tests/test_keras_internals.py.
            per_epoch = backends.step_class().keras_iterators_per_epoch(int(self._dataset.cardinality()) >= 0)
            for _ in range(skipped):
                next(iter(self._dataset), None)  # the epoch's own iterator
                for _ in range(per_epoch - 1):
                    iter(self._dataset)  # Keras' unused one
