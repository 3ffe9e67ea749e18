"""Trains a small CNN on an image pipeline with random augmentation and saves weights and logs.

The augmentation follows the guide's recipe for serial-equal random maps: stateless random
ops with a per-sample seed pair from tf.data.Dataset.random (new each epoch). It also calls
Python per sample. A second model trains on the same samples stored in TFRecord files of uneven
sizes and read with the ImageNet idiom (interleave of TFRecordDatasets, then shuffle, parse, batch),
which tarantella reads about 1/p per rank. `--mode serial` is plain Keras and writes those files
into --records; `--mode tnt` wraps the models in tnt.Model and reads them.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES, BATCH = 75, 16  # batches of 16 x 4 and 11: uneven on 2 and 3 ranks


def pipeline(np, tf):
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(SAMPLES, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, SAMPLES)
    seeds = tf.data.Dataset.random(seed=5, rerandomize_each_iteration=True).batch(2, drop_remainder=True)
    samples = tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices((images, labels)), seeds)

    def augment(sample, seed):
        image, label = sample
        image = tf.ensure_shape(tf.numpy_function(lambda a: a * np.float32(0.9), [image], tf.float32), [8, 8, 1])
        image = tf.image.stateless_random_flip_left_right(image, seed)
        image = tf.image.stateless_random_crop(tf.pad(image, [[1, 1], [1, 1], [0, 0]]), [8, 8, 1], seed + 1)
        return tf.image.stateless_random_brightness(image, 0.2, seed + 2), label

    return samples.shuffle(SAMPLES, seed=1).map(augment, num_parallel_calls=2).batch(BATCH).prefetch(2)


RECORDS_PER_FILE = (30, 9, 36)


def write_records(np, tf, folder):
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(SAMPLES, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, SAMPLES).astype("uint8")
    for part, indices in enumerate(np.split(np.arange(SAMPLES), np.cumsum(RECORDS_PER_FILE)[:-1])):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part{part}.tfrecord")) as writer:
            for i in indices:
                writer.write(images[i].tobytes() + labels[i].tobytes())


def record_pipeline(tf, folder):
    def parse(record):
        raw = tf.io.decode_raw(record, tf.uint8)
        image = tf.reshape(tf.bitcast(tf.reshape(raw[:256], [64, 4]), tf.float32), [8, 8, 1])
        return image, tf.cast(raw[256], tf.int64)

    files = [os.path.join(folder, f"part{part}.tfrecord") for part in range(len(RECORDS_PER_FILE))]
    return tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=2, block_length=2, num_parallel_calls=2, deterministic=True).shuffle(
        SAMPLES, seed=1).map(parse, num_parallel_calls=2).batch(BATCH)


def trained(tnt, keras, make_dataset):
    """Weights and history of a small CNN after 3 epochs on the dataset (made after seeding, as
    tarantella rebuilds seeded shuffles with the global seed of their making)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(3, activation="softmax")])
    if tnt is not None:
        model = tnt.Model(model)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    history = model.fit(make_dataset(), epochs=3, verbose=0)
    return model.get_weights(), history.history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--records", required=True, help="folder of the TFRecord files (written by --mode serial)")
    args = parser.parse_args()
    tnt = None
    if args.mode == "tnt":
        import tarantella as tnt
    import keras
    import numpy as np
    import tensorflow as tf

    if args.mode == "serial":
        write_records(np, tf, args.records)
    arrays = {}
    for prefix, make_dataset in (("", lambda: pipeline(np, tf)), ("records_", lambda: record_pipeline(tf, args.records))):
        weights, history = trained(tnt, keras, make_dataset)
        arrays.update({f"{prefix}weight_{i}": w for i, w in enumerate(weights)})
        arrays.update({f"{prefix}history_{key}": np.array(values) for key, values in history.items()})
    rank = tnt.get_rank() if tnt else 0
    np.savez(os.path.join(args.out, f"augmentation.rank{rank}.npz"), **arrays)


if __name__ == "__main__":
    sys.exit(main())
