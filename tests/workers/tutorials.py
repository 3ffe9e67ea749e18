"""Runs both tutorial examples, reduced to a few steps, in one process per rank (one
TensorFlow start-up for both): `tutorials.py OUT_DIR`. The master writes
OUT_DIR/resnet50.json, OUT_DIR/transformer.json and the ResNet callbacks' files in
OUT_DIR/resnet50_output; then OUT_DIR/tfrecords.json (see train_on_tfrecords)."""

import json
import pathlib
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import resnet50  # noqa: E402  (the examples import tarantella first, as a user's script does)
import transformer  # noqa: E402

# The smallest runs that still take every path: 4 steps of ResNet (the tiny variant: ResNet-50
# itself takes minutes here), 2 of them in warm-up, with validation and the three callbacks;
# two rounds of Transformer training (initial_epoch) with greedy decoding on the master between.
# The ResNet's peak learning rate is 1/10 of the default: at the default, float32 rounding alone
# moves its 4-step loss by ~1e-5 relative (serial Keras with BatchNormalization's two moment
# formulas differs from itself by 9e-6, 2 ranks from serial by 7e-6), the test's tolerance.
RESNET = ["--model", "tiny", "--image-size", "32", "--samples", "64", "--batch-size", "16", "--epochs", "1",
          "--warmup-epochs", "0.5", "--base-learning-rate", "0.01"]
TRANSFORMER = ["--samples", "96", "--batch-size", "32", "--epochs", "2", "--epochs-between-evals", "1",
               "--test-samples", "4", "--max-words", "5", "--warmup-steps", "4"]



def train_on_tfrecords(out):
    """A small model on resnet50.py's TFRecord input (a dataset whose length tf.data does not
    know): History and evaluate. On 2 ranks, the epoch's logs once came out as zeros."""
    import keras
    import tarantella as tnt
    import tensorflow as tf
    folder = out / "records"
    if tnt.is_master_rank():
        folder.mkdir()
        rng = np.random.default_rng(0)
        for shard in range(2):
            with tf.io.TFRecordWriter(str(folder / f"train-{shard}")) as writer:
                for _ in range(10):
                    label = int(rng.integers(0, 2))
                    image = np.full((8, 8, 3), 60 + 120 * label) + rng.integers(0, 40, size=(8, 8, 3))
                    features = {"image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                                    value=[tf.io.encode_png(image.astype(np.uint8)).numpy()])),
                                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
                    writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    tnt.barrier()
    keras.utils.set_random_seed(4)
    dataset = resnet50.tfrecord_dataset(sorted(folder.glob("train-*")), 8, seed=4)
    dataset = dataset.map(lambda image, label: (image / 127.5 - 1.0, label)).batch(6)  # 20 records: 6, 6, 6, 2
    model = tnt.Model(keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Flatten(), keras.layers.Dense(2)]))
    model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dataset, epochs=2, verbose=0)
    evaluation = model.evaluate(dataset, verbose=0)
    if tnt.is_master_rank():
        (out / "tfrecords.json").write_text(json.dumps({"history": history.history, "evaluate": evaluation}))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    resnet50.main(RESNET + ["--output-dir", str(out / "resnet50_output"), "--history-json", str(out / "resnet50.json")])
    transformer.main(TRANSFORMER + ["--history-json", str(out / "transformer.json")])
    train_on_tfrecords(out)
