"""Data-parallel scaling of tarantella on one node, at global batch size 128.

For each model (LeNet-5, and an MLP of about 10M parameters) it measures the
master rank's median training-step time and samples/s of:
  (a) plain Keras in one process, tarantella not imported;
  (b) tarantella at 1 rank, where tnt.Model is plain Keras;
  (c) tarantella at 2 ranks;
  (d) 2 ranks with the gradient allreduce monkeypatched away: the compute-only ceiling,
and prints the (b)/(a) and (c)/(d) step-time ratios against their targets and the
(c)/(a) speed-up in samples/s.

Every variant trains the same model from the same seed on the same random data
(SGD, sparse categorical cross-entropy, accuracy) in a fresh subprocess
(benchmarks/scaling_worker.py), so TensorFlow's thread settings start clean. The
first steps (tracing) are not timed.

The machine is small and shared, so its speed drifts. To compare variants fairly
the runs are interleaved: each repeat runs a, b, c, d for one model, then for the
next model, and each variant's result is the median over repeats of its per-run
median step time. Compare numbers within one invocation only, on a quiet machine.

    python benchmarks/scaling.py [--models lenet5,mlp] [--repeats 3] [--steps N]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_worker.py")
GLOBAL_BATCH_SIZE = 128
RUN_TIMEOUT_S = 300
TIMED_STEPS = {"lenet5": 200, "mlp": 20}  # a few seconds per run on 2 cores

ONE_PROCESS = [sys.executable]
TWO_RANKS = [sys.executable, "-m", "tarantella.launcher", "-n", "2", "--"]
# label, description, command prefix, worker --variant
VARIANTS = [
    ("a", "plain Keras, 1 process", ONE_PROCESS, "keras"),
    ("b", "tarantella, 1 rank", ONE_PROCESS, "tarantella"),
    ("c", "tarantella, 2 ranks", TWO_RANKS, "tarantella"),
    ("d", "2 ranks, no gradient allreduce", TWO_RANKS, "no-allreduce"),
]
# Upper bounds on step-time ratios (numerator, denominator): what tarantella costs at one
# rank, and what the gradient allreduce costs at two.
RATIO_TARGETS = {
    "lenet5": {("b", "a"): 1.02, ("c", "d"): 1.08},
    "mlp": {("b", "a"): 1.02, ("c", "d"): 1.25},
}


def measure(model, prefix, variant, steps, output_path):
    """Runs one worker; returns (parameter count, median step seconds)."""
    command = prefix + [WORKER, "--model", model, "--variant", variant, "--steps", str(steps),
                        "--output", output_path]
    # A session of its own, so a timeout can stop mpiexec and its ranks together.
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        output, _ = worker.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        sys.exit(f"{' '.join(command)} did not finish within {RUN_TIMEOUT_S} s.")
    if worker.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit status {worker.returncode}):\n{output[-5000:]}")
    with open(output_path) as result:
        measured = json.load(result)
    return measured["parameters"], statistics.median(measured["step_seconds"])


def print_table(models, parameters, steps, step_seconds, repeats):
    timed = ", ".join(f"{model} {steps[model]}" for model in models)
    print(f"\nGlobal batch {GLOBAL_BATCH_SIZE}; timed steps per run: {timed}; median over {repeats} "
          "interleaved repeat(s) of each run's median step time.")
    header = (f"{'model':<8}{'parameters':>12}  {'variant':<36}{'step ms':>9}{'samples/s':>11}"
              "  per repeat (ms)")
    print(header)
    print("-" * len(header))
    for model in models:
        median = {label: statistics.median(step_seconds[model][label]) for label, *_ in VARIANTS}
        for index, (label, description, _, _) in enumerate(VARIANTS):
            name, count = (model, f"{parameters[model]:,}") if index == 0 else ("", "")
            per_repeat = " ".join(f"{seconds * 1e3:.1f}" for seconds in step_seconds[model][label])
            print(f"{name:<8}{count:>12}  {f'({label}) {description}':<36}{median[label] * 1e3:>9.2f}"
                  f"{GLOBAL_BATCH_SIZE / median[label]:>11,.0f}  {per_repeat}")
        for (numerator, denominator), target in RATIO_TARGETS[model].items():
            ratio = median[numerator] / median[denominator]
            verdict = "met" if ratio <= target else "MISSED"
            print(f"{'':<22}{f'({numerator})/({denominator}) step time':<36}{ratio:>9.3f}{'':<11}"
                  f"  target <= {target:.2f}: {verdict}")
        # Samples/s of (c) over (a) is the step time of (a) over (c).
        print(f"{'':<22}{'(c)/(a) speed-up in samples/s':<36}{median['a'] / median['c']:>9.2f}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(TIMED_STEPS),
                        help=f"comma-separated, from {', '.join(TIMED_STEPS)} (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of a, b, c, d (default 3)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default: " +
                        ", ".join(f"{model} {steps}" for model, steps in TIMED_STEPS.items()) + ")")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [model for model in models if model not in TIMED_STEPS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(TIMED_STEPS)}")
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--repeats and --steps must be at least 1")
    steps = {model: args.steps or TIMED_STEPS[model] for model in models}

    parameters = {}
    step_seconds = {model: {label: [] for label, *_ in VARIANTS} for model in models}
    runs = args.repeats * len(models) * len(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="tnt-scaling-") as scratch:
        for repeat in range(args.repeats):
            for model in models:
                for label, description, prefix, variant in VARIANTS:
                    output_path = os.path.join(scratch, f"{repeat}-{model}-{label}.json")
                    parameters[model], seconds = measure(model, prefix, variant, steps[model], output_path)
                    step_seconds[model][label].append(seconds)
                    done = sum(len(times) for per_model in step_seconds.values() for times in per_model.values())
                    print(f"[{done}/{runs}] {model} ({label}) {description}: {seconds * 1e3:.2f} ms/step",
                          file=sys.stderr, flush=True)
    print_table(models, parameters, steps, step_seconds, args.repeats)


if __name__ == "__main__":
    main()
