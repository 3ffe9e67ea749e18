"""Runs both tutorial examples, reduced to a few steps, in one process per rank (one
TensorFlow start-up for both): `tutorials.py OUT_DIR`. The master writes
OUT_DIR/resnet50.json, OUT_DIR/transformer.json and the ResNet callbacks' files in
OUT_DIR/resnet50_output."""

import pathlib
import sys

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

if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    resnet50.main(RESNET + ["--output-dir", str(out / "resnet50_output"), "--history-json", str(out / "resnet50.json")])
    transformer.main(TRANSFORMER + ["--history-json", str(out / "transformer.json")])
