"""Trains a small CNN on an image pipeline with random augmentation and saves weights and logs.

The augmentation follows the guide's recipe for serial-equal random maps: stateless random
ops with a per-sample seed pair from tf.data.Dataset.random (new each epoch). It also calls
Python per sample. `--mode serial` is plain Keras; `--mode tnt` wraps the model in tnt.Model.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["serial", "tnt"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "tnt":
        import tarantella as tnt
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(3, activation="softmax")])
    if args.mode == "tnt":
        model = tnt.Model(model)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    history = model.fit(pipeline(np, tf), epochs=3, verbose=0)
    rank = tnt.get_rank() if args.mode == "tnt" else 0
    arrays = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"history_{key}": np.array(values) for key, values in history.history.items()})
    np.savez(os.path.join(args.out, f"augmentation.rank{rank}.npz"), **arrays)


if __name__ == "__main__":
    sys.exit(main())
