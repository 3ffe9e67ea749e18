"""The manual's ResNet-50 tutorial on Keras 3: image classification, data-parallel.

Serial:    python examples/resnet50.py
Two ranks: tarantella -n 2 -- examples/resnet50.py

`--batch-size` is the global batch: tarantella splits each batch across the ranks, so the
optimizer sees the same batches, and the History is the same, on any number of ranks.
The learning rate grows linearly to its peak during the warm-up epochs and then decays
exponentially; the peak is scaled linearly with the global batch (0.1 per 256 samples, the
rule of Goyal et al.). BatchNormalization is synchronized over the ranks, so it normalizes
with the statistics of the whole global batch, as one process would.

Data (`--data-dir DIR`):
- a folder with one subfolder of images per class (read with
  `keras.utils.image_dataset_from_directory`; 10% are held out for validation);
- or a folder of TFRecord files named `train-*` and `validation-*` (the ImageNet layout),
  whose records hold an encoded JPEG/PNG in `image/encoded` and a class number counted
  from 0 in `image/class/label`; give `--classes`.
Without `--data-dir`, a small synthetic set is generated (each class its own colour and
stripe direction): 3 epochs of 8 steps at 32x32, about 70 seconds on 2 ranks of a 2-core
machine. ResNet-50 learns the training set in them, but its validation loss is meaningless
after so few steps (the moving statistics of 53 BatchNormalization layers have not settled);
use `--model tiny`, or real data and more epochs, to see it validate.

Serial and 2-rank runs give the same History (within 1e-5) for short runs of `--model tiny`
at a tenth of the default learning rate (tests/test_tutorial_examples.py). Longer runs at the
default rate drift apart, as any two serial runs whose sums round differently would (the tiny
model's 3 default epochs: 3e-4 in the loss). ResNet-50 from a random start amplifies rounding
far more: serial runs of this script whose batches differ only in the order of their rows
give first-epoch losses 4.4% apart (second epoch: 39%), and a 2-rank run differs from serial
as much (7.4%, 41%).

The master alone writes the callbacks' files into `--output-dir`: the weights after each
epoch (ModelCheckpoint; `--checkpoint-every-steps N` for every N steps, and
`--checkpoint-in-background` to write them while training goes on), the logs per epoch
(CSVLogger) and TensorBoard summaries.
"""

import argparse
import json
import math
import pathlib

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf

REFERENCE_BATCH = 256  # the peak learning rate is --base-learning-rate per this many samples


@keras.saving.register_keras_serializable(package="tarantella_examples")
class WarmupExponentialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak_learning_rate` over `warmup_steps`, then exponential decay:
    the rate is multiplied by `decay_rate` every `decay_steps` steps."""

    def __init__(self, peak_learning_rate, warmup_steps, decay_steps, decay_rate):
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate

    def __call__(self, step):
        # Keras passes the number of updates made so far; the first update is step 1 here,
        # so that it does not run with a learning rate of 0.
        step = tf.cast(step, tf.float32) + 1.0
        warmup = self.peak_learning_rate * step / max(self.warmup_steps, 1)
        decay = self.peak_learning_rate * self.decay_rate ** ((step - self.warmup_steps) / self.decay_steps)
        return tf.where(step <= self.warmup_steps, warmup, decay)

    def get_config(self):
        return {"peak_learning_rate": self.peak_learning_rate, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_rate": self.decay_rate}


def synthetic_images(samples, image_size, classes, seed):
    """Images in [0, 255] that a network can tell apart: each class has its own colour and
    stripe direction, under per-sample noise and brightness."""
    rng = np.random.default_rng(seed)
    palette = np.random.default_rng(0).uniform(40, 215, size=(classes, 3))  # the same for every split
    labels = rng.integers(0, classes, size=samples)
    grid = np.arange(image_size, dtype=np.float32)
    angles = np.pi * np.arange(classes) / classes
    phase = rng.uniform(0, 2 * np.pi, size=(samples, 1, 1))
    direction = (np.cos(angles[labels])[:, None, None] * grid[None, :, None]
                 + np.sin(angles[labels])[:, None, None] * grid[None, None, :])
    stripes = 30.0 * np.sin(direction * (2 * np.pi / 8) + phase)
    brightness = rng.uniform(0.8, 1.2, size=(samples, 1, 1, 1))
    images = palette[labels][:, None, None, :] * brightness + stripes[..., None]
    images += rng.normal(0, 15, size=images.shape)
    return np.clip(images, 0, 255).astype(np.float32), labels.astype(np.int32)


def tfrecord_dataset(files, image_size, seed):
    """Records of one split; each rank parses and decodes only the records it trains on."""
    features = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                "image/class/label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        parsed = tf.io.parse_single_example(record, features)
        image = tf.io.decode_image(parsed["image/encoded"], channels=3, expand_animations=False)
        image = tf.image.resize(tf.cast(image, tf.float32), [image_size, image_size])
        return image, tf.cast(parsed["image/class/label"], tf.int32)

    files = sorted(str(f) for f in files)
    np.random.default_rng(seed).shuffle(files)  # the same order on every rank
    return tf.data.TFRecordDataset(files).shuffle(10000, seed=seed).map(parse)


def datasets(args):
    """Unbatched train and validation sets (images in [0, 255], integer labels), the number
    of training samples, and the number of classes."""
    if args.data_dir is None:
        train = synthetic_images(args.samples, args.image_size, args.classes, args.seed)
        validation = synthetic_images(max(args.samples // 4, 1), args.image_size, args.classes, args.seed + 1)
        train = tf.data.Dataset.from_tensor_slices(train).shuffle(args.samples, seed=args.seed)
        return train, tf.data.Dataset.from_tensor_slices(validation), args.samples, args.classes
    data_dir = pathlib.Path(args.data_dir)
    train_files = sorted(data_dir.glob("train-*"))
    if train_files:
        if args.classes is None:
            raise SystemExit("TFRecord data needs --classes, the number of classes.")
        samples = sum(1 for _ in tf.data.TFRecordDataset([str(f) for f in train_files]))
        return (tfrecord_dataset(train_files, args.image_size, args.seed),
                tfrecord_dataset(sorted(data_dir.glob("validation-*")), args.image_size, args.seed),
                samples, args.classes)
    train, validation = keras.utils.image_dataset_from_directory(
        data_dir, image_size=(args.image_size, args.image_size), batch_size=None, label_mode="int",
        validation_split=0.1, subset="both", seed=args.seed)
    return train, validation, int(train.cardinality()), len(train.class_names)


def tiny_resnet(input_shape, classes):
    """Two stages of ResNet-50's bottleneck blocks, for quick tests of the script."""
    inputs = keras.Input(input_shape)
    batch_normalization = keras.layers.BatchNormalization
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(batch_normalization()(x))
    for filters, stride in [(16, 1), (32, 2)]:
        shortcut = keras.layers.Conv2D(4 * filters, 1, strides=stride, use_bias=False)(x)
        shortcut = batch_normalization()(shortcut)
        y = keras.layers.Conv2D(filters, 1, use_bias=False)(x)
        y = keras.layers.ReLU()(batch_normalization()(y))
        y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(y)
        y = keras.layers.ReLU()(batch_normalization()(y))
        y = keras.layers.Conv2D(4 * filters, 1, use_bias=False)(y)
        y = batch_normalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(x), name="tiny_resnet")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a folder of class subfolders, or of train-*/validation-* TFRecords")
    parser.add_argument("--image-size", type=int, default=32, help="images are resized to this square size")
    parser.add_argument("--classes", type=int, help="number of classes (synthetic data: default 4)")
    parser.add_argument("--samples", type=int, default=256, help="synthetic training images")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup-epochs", type=float, default=1, help="the tutorial warms up for 5 of 90")
    parser.add_argument("--base-learning-rate", type=float, default=0.1,
                        help=f"the peak learning rate for a global batch of {REFERENCE_BATCH}")
    parser.add_argument("--decay-rate", type=float, default=0.5, help="learning rate factor per epoch after warm-up")
    parser.add_argument("--batch-norm-momentum", type=float, default=0.9,
                        help="as in the TF Model Garden's ResNet; Keras' 0.99 suits long runs only")
    parser.add_argument("--model", choices=["resnet50", "tiny"], default="resnet50",
                        help="tiny: two bottleneck stages instead of ResNet-50, for quick tests")
    parser.add_argument("--checkpoint-every-steps", type=int,
                        help="ModelCheckpoint saves after every this many steps (default: after each epoch)")
    parser.add_argument("--checkpoint-in-background", action="store_true",
                        help="ModelCheckpoint writes from a thread while training goes on (tarantella's "
                             "write_in_background)")
    parser.add_argument("--output-dir", default="resnet50_output", help="the callbacks' files (master only)")
    parser.add_argument("--history-json", help="the master writes the History here")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.data_dir is None and args.classes is None:
        args.classes = 4

    keras.utils.set_random_seed(args.seed)
    train, validation, train_samples, classes = datasets(args)
    # Trained from scratch, so any fixed scaling works; [-1, 1] keeps the first layers' outputs
    # near the BatchNormalization layers' initial moving statistics (mean 0, variance 1).
    preprocess = lambda image, label: (image / 127.5 - 1.0, label)
    # Batched with the global batch: tarantella gives each rank its rows of every batch.
    train = train.map(preprocess).batch(args.batch_size).prefetch(tf.data.AUTOTUNE)
    validation = validation.map(preprocess).batch(args.batch_size)

    input_shape = (args.image_size, args.image_size, 3)
    if args.model == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=input_shape, classes=classes)
    else:
        model = tiny_resnet(input_shape, classes)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            # With Keras' 0.99, the moving statistics that validation uses still hold much of their
            # initial values after a short run, and the validation loss explodes.
            layer.momentum = args.batch_norm_momentum
    model = tnt.Model(model, synchronized_batch_normalization=True)

    steps_per_epoch = math.ceil(train_samples / args.batch_size)
    schedule = WarmupExponentialDecay(
        peak_learning_rate=args.base_learning_rate * args.batch_size / REFERENCE_BATCH,
        warmup_steps=math.ceil(args.warmup_epochs * steps_per_epoch),
        decay_steps=steps_per_epoch, decay_rate=args.decay_rate)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=schedule, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])

    # Plain Keras callbacks: tarantella runs these three on the master only.
    output_dir = pathlib.Path(args.output_dir)
    checkpoint = keras.callbacks.ModelCheckpoint(str(output_dir / "checkpoint.weights.h5"), save_weights_only=True,
                                                 save_freq=args.checkpoint_every_steps or "epoch")
    if args.checkpoint_in_background:
        checkpoint = tnt.keras.callbacks.Callback(checkpoint, write_in_background=True)
    callbacks = [checkpoint,
                 keras.callbacks.CSVLogger(str(output_dir / "training_log.csv")),
                 keras.callbacks.TensorBoard(log_dir=str(output_dir / "tensorboard"))]
    if tnt.is_master_rank():
        output_dir.mkdir(parents=True, exist_ok=True)

    history = model.fit(train, validation_data=validation, epochs=args.epochs, callbacks=callbacks, verbose=2)

    if tnt.is_master_rank():
        print(f"trained {model.name} on {tnt.get_size()} rank(s); final validation accuracy "
              f"{history.history['val_sparse_categorical_accuracy'][-1]:.3f}", flush=True)
        if args.history_json:
            # The weights' sum of squares identifies the final weights (and the last checkpoint).
            squares = sum(float(np.sum(np.square(w, dtype=np.float64))) for w in model.get_weights())
            pathlib.Path(args.history_json).write_text(json.dumps(
                {"ranks": tnt.get_size(), "history": history.history, "weights_sum_of_squares": squares}, indent=1))


if __name__ == "__main__":
    main()
