"""What a 16-bit gradient wire costs in accuracy, measured on the conformance zoo's models.

For each backend, the zoo's worker (tests/workers/zoo.py: real model families, 2 epochs of 3 global
batches, 6 steps) trains each case serially with plain Keras, then under tnt.Model on --ranks ranks
once per wire (TNT_GRADIENT_WIRE). Per case and wire it reports, against serial Keras:
  weights   the largest difference of any weight, over the largest serial weight
  loss      the largest relative difference of the History's training loss, over the epochs
  evaluate  the relative difference of evaluate's loss
float32 is the control: it shows the rounding noise of the exact sum. docs/performance.md quotes the
table.

  python benchmarks/gradient_wire_error.py [--backend tensorflow,jax,torch] [--cases a,b,...]
      [--ranks 2] [--wires float32,bfloat16,float16] [--json FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ZOO = os.path.join(HERE, "..", "tests", "workers", "zoo.py")
DEFAULT_CASES = ("resnet50v2-bn-frozen", "transformer-encoder-classifier", "lstm-timeseries-regression",
                 "conv1d-text-classifier", "recommender-two-tower-dot", "multi-input-multi-output",
                 "optimizer-sgd", "mixed-float16-loss-scale")


def run(command, env):
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    if process.returncode != 0:
        sys.exit(f"gradient_wire_error: {' '.join(command)} failed:\n{process.stderr[-3000:]}")


def results(folder, case):
    path = os.path.join(folder, f"{case}.rank0.npz")
    if not os.path.exists(path):
        error = os.path.join(folder, f"{case}.rank0.error")
        return open(error).read().splitlines()[0] if os.path.exists(error) else "no result"
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def errors(serial, parallel):
    weights = [key for key in serial if key.startswith("weight_")]
    scale = max(float(np.abs(serial[key]).max()) for key in weights)
    relative = lambda a, b: float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))
    row = {"weights": max(float(np.abs(parallel[key] - serial[key]).max()) for key in weights) / scale,
           "loss": relative(parallel["history_loss"], serial["history_loss"])}
    if "evaluate_loss" in serial:
        row["evaluate"] = relative(parallel["evaluate_loss"], serial["evaluate_loss"])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="tensorflow")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--wires", default="float32,bfloat16,float16")
    parser.add_argument("--json")
    args = parser.parse_args()
    cases, wires = args.cases.split(","), args.wires.split(",")
    launcher = os.path.join(os.path.dirname(sys.executable), "tarantella")
    table = {}
    for backend in args.backend.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
        with tempfile.TemporaryDirectory() as scratch:
            serial = os.path.join(scratch, "serial")
            os.mkdir(serial)
            run([sys.executable, ZOO, "--mode", "serial", "--out", serial, "--cases", ",".join(cases)], env)
            for wire in wires:
                folder = os.path.join(scratch, wire)
                os.mkdir(folder)
                run([launcher, "-n", str(args.ranks), "-x", f"TNT_GRADIENT_WIRE={wire}", "--", ZOO, "--mode", "tnt",
                     "--out", folder, "--cases", ",".join(cases)], env)
                for case in cases:
                    reference, measured = results(serial, case), results(folder, case)
                    entry = table.setdefault(backend, {}).setdefault(case, {})
                    entry[wire] = (errors(reference, measured) if isinstance(reference, dict) and
                                   isinstance(measured, dict) else {"error": measured if isinstance(measured, str)
                                                                    else reference})
    print(f"Against serial Keras after 6 steps on {args.ranks} ranks: weights (largest difference / largest "
          "weight), training loss and evaluate loss (largest relative difference).\n")
    print("| backend | case | " + " | ".join(f"{wire} weights | {wire} loss | {wire} evaluate" for wire in wires) + " |")
    print("|---|---|" + "---|---|---|" * len(wires))
    for backend, by_case in table.items():
        for case, by_wire in by_case.items():
            cells = []
            for wire in wires:
                row = by_wire[wire]
                cells += ([row["error"][:40], "", ""] if "error" in row else
                          [f"{row['weights']:.1e}", f"{row['loss']:.1e}",
                           f"{row['evaluate']:.1e}" if "evaluate" in row else ""])
            print(f"| {backend} | {case} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"ranks": args.ranks, "errors": table}, stream, indent=1)


if __name__ == "__main__":
    main()
