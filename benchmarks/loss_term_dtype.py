"""Which dtype the global loss terms should compute in: float32 or float64, measured on each Keras backend.

A compiled loss that does not divide by the micro-batch's entries (a masked mean, a mean over
summed sample weights, a sum) is made global by tarantella.backends.loss_terms: each rank's
divisor is summed over the ranks and its loss value rescaled. This script runs exactly that code
on the parts r::p of one batch, in one process (the sum over ranks is the sum of the parts'
divisors), with its arithmetic in float32 and in float64, and prints the largest relative
distance of the combined loss sum_r (m_r/B) * term_r from serial Keras' loss of the whole batch,
over p = 2, 3, 4, 8 and 20 random batches.

    python benchmarks/loss_term_dtype.py            # every backend, one child process each
    KERAS_BACKEND=jax python benchmarks/loss_term_dtype.py --child
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BACKENDS = ("tensorflow", "jax", "torch")
RANKS = (2, 3, 4, 8)
BATCHES = 20
BATCH, TIMESTEPS, CLASSES = 48, 12, 20


def measure():
    """{loss name: {dtype: largest relative distance from serial}} on this process's backend."""
    if os.environ.get("KERAS_BACKEND") == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)  # else JAX cannot compute in float64 at all
    import keras
    import numpy as np

    from tarantella.backends import loss_terms

    losses = {
        "masked mean (ignore_class=0)": (keras.losses.SparseCategoricalCrossentropy(ignore_class=0), False),
        "mean_with_sample_weight": (keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"),
                                    True),
        "sum": (keras.losses.SparseCategoricalCrossentropy(reduction="sum"), True),
    }
    worst = {name: {} for name in losses}
    rng = np.random.default_rng(0)
    for _ in range(BATCHES):
        logits = rng.normal(size=(BATCH, TIMESTEPS, CLASSES)).astype(np.float32)
        y_pred = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        y_true = rng.integers(0, CLASSES, size=(BATCH, TIMESTEPS))
        y_true[rng.random((BATCH, TIMESTEPS)) < 0.3] = 0  # about a third ignored
        weights = rng.uniform(0.0, 2.0, size=(BATCH, TIMESTEPS)).astype(np.float32)
        for name, (loss, weighted) in losses.items():
            sample_weight = weights if weighted else None
            serial = float(keras.ops.convert_to_numpy(loss(y_true, y_pred, sample_weight)))
            for dtype in ("float32", "float64"):
                loss_terms.ARITHMETIC_DTYPE = dtype
                for ranks in RANKS:
                    combined = _combined(loss_terms, loss, y_true, y_pred, sample_weight, ranks, keras, np)
                    distance = abs(combined - serial) / abs(serial)
                    worst[name][dtype] = max(worst[name].get(dtype, 0.0), distance)
    return worst


def _combined(loss_terms, loss, y_true, y_pred, sample_weight, ranks, keras, np):
    parts = [slice(rank, None, ranks) for rank in range(ranks)]
    part_weight = lambda rows: None if sample_weight is None else sample_weight[rows]
    divisors = []

    def recorded(local):  # the first pass only records each part's divisor
        divisors.append(float(keras.ops.convert_to_numpy(local)))
        return local

    for rows in parts:
        loss_terms._GlobalLossTerm(loss, lambda: 1.0, recorded)(y_true[rows], y_pred[rows], part_weight(rows))
    total = float(np.sum(np.array(divisors, np.float64)))  # as the ranks' host-side sum, in float64
    combined = 0.0
    for rows in parts:
        samples = len(y_true[rows])
        term = loss_terms._GlobalLossTerm(loss, lambda: BATCH / samples, lambda local: total)(
            y_true[rows], y_pred[rows], part_weight(rows))
        combined += samples / BATCH * float(keras.ops.convert_to_numpy(term))
    return combined


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help="measure on KERAS_BACKEND and print JSON")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    print(f"largest |combined - serial| / |serial| over p in {RANKS} and {BATCHES} batches of {BATCH}")
    for backend in BACKENDS:
        done = subprocess.run([sys.executable, __file__, "--child"], env=dict(os.environ, KERAS_BACKEND=backend),
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{backend}: failed\n{done.stderr[-2000:]}")
            continue
        for name, by_dtype in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"{backend:10s} {name:30s} float32 {by_dtype['float32']:.2e}   float64 {by_dtype['float64']:.2e}")


if __name__ == "__main__":
    main()
