"""Data-parallel scaling of tarantella on one node, robust to a noisy machine.

For each model (LeNet-5; an MLP of about 10M parameters; ResNet-50 at 32x32 inputs; a small
Transformer encoder with masked attention and sparse embedding gradients) it measures the
master rank's training-step time and samples/s of:
  (a) plain Keras in one process, tarantella not imported;
  (b) tarantella at 1 rank, where tnt.Model is plain Keras;
  (c) tarantella at 2 ranks;
  (d) 2 ranks with the gradient allreduce monkeypatched away: the compute-only ceiling;
  (e) ResNet-50 only: 2 ranks with synchronized BatchNormalization;
  (@REV) with --against REV: tarantella as it was at git revision REV, at 2 ranks (a git
      worktree of REV, imported by the same Python and packages; the worker is this one);
and judges the step-time ratios (b)/(a), (c)/(d), (e)/(c) and (c)/(@REV) against their
targets: this code may not be slower than REV. It also
counts tarantella's agreement allreduces per step (one opens each step; there is no switch)
and times one.

Every variant trains the same model from the same seed on the same random data (SGD,
sparse categorical cross-entropy, accuracy). How noise is kept out:
- All variants of one model start together (benchmarks/scaling_worker.py) and stay alive;
  after tracing, each waits, taking no CPU, until told to run one timed window of a few
  steps. Only one variant runs at a time.
- A round runs one window of every variant, in the order a, b, c, d (, e), the next round
  in reverse, and so on, so drift of the machine's speed hits all variants alike.
- A window's step time is the median of its steps; a ratio is computed per round, from
  windows run moments apart, and reported as the median over rounds with its spread (the
  interquartile range, and min-max). A target is judged only when the whole interquartile
  range lies on one side of it; otherwise the output says the spread is too large to judge.
Compare numbers within one invocation only, on a quiet machine.

    python benchmarks/scaling.py [--models lenet5,mlp,resnet50,transformer] [--repeats 12]
        [--steps N] [--quick] [--plot FILE.png] [--json FILE.json]
        [--against REV[,REV...]] [--variants a,b,c,d,e,@REV]
    python benchmarks/scaling.py --compare FIRST.json SECOND.json
"""

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_worker.py")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # --against checks revisions out of it
DEFAULT_REPEATS = 12
WARMUP_STEPS = 3
# Timed steps per window: about 0.2-1 s of work per window on 2 cores.
STEPS_PER_WINDOW = {"lenet5": 40, "mlp": 8, "resnet50": 2, "transformer": 3}
AGREEMENT = 0.05  # two runs on a quiet machine should give every ratio within 5% of each other
MIN_ROUNDS_TO_JUDGE = 5  # fewer give no meaningful quartiles
QUICK = {"repeats": 2, "steps": 2, "warmup": 2}
START_TIMEOUT_S = 600  # all variants of a model start and trace together on a small machine
WINDOW_TIMEOUT_S = 300

# label -> (description, ranks, worker --variant)
VARIANTS = {
    "a": ("plain Keras, 1 process", 1, "keras"),
    "b": ("tarantella, 1 rank", 1, "tarantella"),
    "c": ("tarantella, 2 ranks", 2, "tarantella"),
    "d": ("2 ranks, no gradient allreduce", 2, "no-allreduce"),
    "e": ("2 ranks, synchronized BatchNorm", 2, "sync-bn"),
    # Ablations, timed only when named in --variants: what each safety mechanism costs.
    "no-agreement": ("2 ranks, no agreement allreduce", 2, "no-agreement"),
    "no-monitor": ("2 ranks, no peer monitor", 2, "no-monitor"),
    "no-agreement-no-monitor": ("2 ranks, neither", 2, "no-agreement-no-monitor"),
}
# Upper bounds on step-time ratios (numerator, denominator): what tarantella costs at one
# rank, what the gradient allreduce costs at two, and what synchronized BatchNormalization adds.
RATIO_TARGETS = {
    "lenet5": {("b", "a"): 1.02, ("c", "d"): 1.08},
    "mlp": {("b", "a"): 1.02, ("c", "d"): 1.25},
    "resnet50": {("b", "a"): 1.02, ("c", "d"): 1.10, ("e", "c"): 1.10},
    "transformer": {("b", "a"): 1.02, ("c", "d"): 1.10},
}
MODELS = list(RATIO_TARGETS)
MODEL_VARIANTS = {model: list("abcde" if model == "resnet50" else "abcd") for model in MODELS}
# (c)/(@REV): the code under test against an earlier revision of itself.
AGAINST_TARGET = 1.00


def against_variants(revisions, scratch):
    """label -> (description, ranks, worker variant, folder to import tarantella from) per revision,
    each checked out into a git worktree of its own under `scratch` (removed with it)."""
    variants = {}
    for revision in revisions:
        folder = os.path.join(scratch, f"revision-{len(variants)}")
        subprocess.run(["git", "-C", REPOSITORY, "worktree", "add", "--detach", "--quiet", folder, revision],
                       check=True)
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        variants[f"@{revision}"] = (f"tarantella at {commit}, 2 ranks", 2, "tarantella", folder)
    return variants


def remove_worktrees(variants):
    for *_, folder in variants.values():
        if folder is not None:
            subprocess.run(["git", "-C", REPOSITORY, "worktree", "remove", "--force", folder], check=False)


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One variant's worker process (or 2-rank job), driven through FIFOs."""

    def __init__(self, model, label, variant_spec, windows, steps, warmup, scratch):
        description, ranks, variant, source = variant_spec
        self.name = f"{model} ({label}) {description}"
        self.control = os.path.join(scratch, f"{model}-{label.replace('@', 'at-').replace('/', '-')}")
        os.mkdir(self.control)
        # Opened read-write, so that neither side blocks in open() and a reader never sees EOF.
        self._go = []
        for rank in range(ranks):
            path = os.path.join(self.control, f"go-{rank}")
            os.mkfifo(path)
            self._go.append(os.open(path, os.O_RDWR))
        os.mkfifo(os.path.join(self.control, "results"))
        self._results = os.open(os.path.join(self.control, "results"), os.O_RDWR | os.O_NONBLOCK)
        self._received = b""
        prefix = [sys.executable] if ranks == 1 else [sys.executable, "-m", "tarantella.launcher", "-n",
                                                      str(ranks), "--"]
        self.command = prefix + [WORKER, "--model", model, "--variant", variant, "--windows", str(windows),
                                 "--steps-per-window", str(steps), "--warmup-steps", str(warmup),
                                 "--control", self.control]
        self._log_path = os.path.join(self.control, "output.log")
        environment = dict(os.environ)
        if source is not None:  # the launcher and the ranks import that revision's tarantella
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
        with open(self._log_path, "w") as log:
            # A session of its own, so that stop() ends the launcher and its ranks together.
            self._process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=environment)

    def send(self, command):
        for fifo in self._go:
            os.write(fifo, f"{command}\n".encode())

    def receive(self, timeout_s):
        """The next JSON line the worker's master rank writes."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._received:
            if self._process.poll() is not None:
                raise WorkerFailed(f"{self.name} ended (exit status {self._process.returncode}) before it "
                                   f"answered.\n{' '.join(self.command)}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"{self.name} did not answer within {timeout_s} s.\n{self.log_tail()}")
            if select.select([self._results], [], [], 0.5)[0]:
                self._received += os.read(self._results, 1 << 16)
        line, self._received = self._received.split(b"\n", 1)
        return json.loads(line)

    def finish(self, timeout_s):
        self.send("end")
        try:
            status = self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise WorkerFailed(f"{self.name} did not end within {timeout_s} s.\n{self.log_tail()}") from None
        if status != 0:
            raise WorkerFailed(f"{self.name} failed (exit status {status}).\n{self.log_tail()}")

    def stop(self):
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        for fd in self._go + [self._results]:
            os.close(fd)

    def log_tail(self):
        with open(self._log_path, errors="replace") as log:
            return log.read()[-5000:]


def measure_model(model, variants, repeats, steps, warmup, scratch):
    """Runs the `variants` ({label: spec}) of `model` for `repeats` interleaved rounds; returns the raw
    results."""
    labels = list(variants)
    started = time.monotonic()
    workers = {}
    try:
        for label in labels:
            workers[label] = Worker(model, label, variants[label], repeats, steps, warmup, scratch)
        ready = {label: worker.receive(START_TIMEOUT_S) for label, worker in workers.items()}
        for label, (*_, source) in variants.items():
            if source is not None and os.path.realpath(ready[label]["tarantella_folder"]) != os.path.realpath(source):
                raise WorkerFailed(f"{workers[label].name} imported tarantella from "
                                   f"{ready[label]['tarantella_folder']}, not from its revision's {source}.")
        start_seconds = time.monotonic() - started
        print(f"{model}: all variants traced and ready after {start_seconds:.0f} s", file=sys.stderr, flush=True)
        windows = {label: [] for label in labels}
        for repeat in range(repeats):
            order = labels if repeat % 2 == 0 else labels[::-1]
            for label in order:
                workers[label].send("window")
                windows[label].append(workers[label].receive(WINDOW_TIMEOUT_S))
            print(f"[{model} round {repeat + 1}/{repeats}] " + " ".join(
                f"{label} {windows[label][-1]['median_step_seconds'] * 1e3:.1f}" for label in labels) + " ms/step",
                file=sys.stderr, flush=True)
        agreement = {"agreement_seconds": None, "collective_seconds": None}
        if "c" in workers:
            workers["c"].send("agreement")
            agreement = workers["c"].receive(WINDOW_TIMEOUT_S)
        for worker in workers.values():
            worker.finish(WINDOW_TIMEOUT_S)
    finally:
        for worker in workers.values():
            worker.stop()
    first = ready[labels[0]]
    return {"parameters": first["parameters"], "global_batch_size": first["global_batch_size"],
            "steps_per_window": steps, "start_seconds": start_seconds,
            "seconds": time.monotonic() - started, "windows": windows, "agreement": agreement,
            "variants": {label: {"description": spec[0], "ranks": spec[1]} for label, spec in variants.items()}}


# -- statistics --------------------------------------------------------------------------

def summarize(values):
    """Median, quartiles and extremes of a list of numbers."""
    ordered = sorted(values)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1]}


def verdict(spread, target, rounds):
    """'met' or 'MISSED' when the interquartile range lies wholly on one side of the target."""
    if rounds < MIN_ROUNDS_TO_JUDGE:
        return f"too few rounds to judge (fewer than {MIN_ROUNDS_TO_JUDGE})"
    if spread["q3"] <= target:
        return "met"
    if spread["q1"] > target:
        return "MISSED"
    return "spread too large to judge"


def analyze(model, measured):
    """Step times per variant, and each target ratio from paired rounds, with their spread."""
    step = {label: [w["median_step_seconds"] for w in windows] for label, windows in measured["windows"].items()}
    ratios = {}
    targets = {**RATIO_TARGETS[model], **{("c", label): AGAINST_TARGET for label in step if label.startswith("@")},
               **{("c", label): None for label in step if label.startswith("no-")}}
    for (numerator, denominator), target in targets.items():
        if numerator not in step or denominator not in step:
            continue
        # Per round: the two windows ran moments apart, so the machine's drift cancels.
        per_round = [n / d for n, d in zip(step[numerator], step[denominator])]
        spread = summarize(per_round)
        ratios[f"{numerator}/{denominator}"] = {
            **spread, "per_round": per_round, "target": target,
            "verdict": "measured, not judged" if target is None else verdict(spread, target, len(per_round))}
    # Samples/s of (c) over (a) is the step time of (a) over (c).
    speed_up = summarize([a / c for a, c in zip(step["a"], step["c"])]) if "a" in step and "c" in step else None
    ranks = {label: spec["ranks"] for label, spec in measured.get("variants", {}).items()}
    agreements = {label: statistics.median(w["agreements_per_step"] for w in measured["windows"][label])
                  for label in measured["windows"] if ranks.get(label, VARIANTS.get(label, (0, 1))[1]) > 1
                  and None not in [w.get("agreements_per_step") for w in measured["windows"][label]]}
    return {"step_seconds": {label: {**summarize(times), "per_round": times} for label, times in step.items()},
            "ratios": ratios, "speed_up_c_over_a": speed_up, "agreements_per_step": agreements}


# -- output ------------------------------------------------------------------------------

def relative_spread(spread):
    median = spread["median"]
    return f"{(spread['q1'] / median - 1) * 100:+.0f}%/{(spread['q3'] / median - 1) * 100:+.0f}%"


def print_report(results, repeats):
    print(f"\nMedian over {repeats} interleaved round(s) of each window's median step time; IQR: interquartile "
          "range relative to the median.")
    header = (f"{'model':<12}{'params':>12}  {'variant':<38}{'step ms':>9}{'IQR':>12}{'samples/s':>11}")
    print(header)
    print("-" * len(header))
    for model, result in results.items():
        measured, analysis = result["measured"], result["analysis"]
        batch = measured["global_batch_size"]
        for index, (label, spread) in enumerate(analysis["step_seconds"].items()):
            name, count = (model, f"{measured['parameters']:,}") if index == 0 else ("", "")
            description = f"({label}) {measured['variants'][label]['description']}"
            print(f"{name:<12}{count:>12}  {description:<38}{spread['median'] * 1e3:>9.2f}"
                  f"{relative_spread(spread):>12}{batch / spread['median']:>11,.0f}")
        print(f"{'':<26}global batch {batch}, {measured['steps_per_window']} timed step(s) per window")
        for name, ratio in analysis["ratios"].items():
            numerator, denominator = name.split("/", 1)
            quartiles = f"{ratio['q1']:.3f}-{ratio['q3']:.3f}"
            print(f"{'':<26}{f'({numerator})/({denominator}) step time':<38}{ratio['median']:>9.3f}"
                  f"{quartiles:>12}  min-max {ratio['min']:.3f}-{ratio['max']:.3f}, "
                  + (f"target <= {ratio['target']:.2f}: " if ratio["target"] is not None else "") + ratio["verdict"])
        speed_up = analysis["speed_up_c_over_a"]
        if speed_up is not None:
            quartiles = f"{speed_up['q1']:.2f}-{speed_up['q3']:.2f}"
            print(f"{'':<26}{'(c)/(a) speed-up in samples/s':<38}{speed_up['median']:>9.2f}{quartiles:>12}")
        print_agreement(analysis, measured)
        print()


def print_agreement(analysis, measured):
    agreement = measured["agreement"]
    counts = analysis["agreements_per_step"]
    line = f"{'':<26}tarantella agreements per step: " + ", ".join(f"({l}) {n:g}" for l, n in counts.items())
    if agreement["agreement_seconds"] is not None:
        costs = ", ".join(
            f"({label}) {count * agreement['agreement_seconds'] * 1e3:.2f} ms = "
            f"{count * agreement['agreement_seconds'] / analysis['step_seconds'][label]['median'] * 100:.1f}%"
            for label, count in counts.items())
        line += (f".\n{'':<26}Each is a 24-byte allreduce of "
                 f"{agreement['agreement_seconds'] * 1e6:.0f} us (a whole synchronous 24-byte collective: "
                 f"{agreement['collective_seconds'] * 1e6:.0f} us); agreeing per step: {costs} of the step")
    print(line)


def compare(first_path, second_path):
    """Prints how far two runs' ratio medians lie apart; returns False if any exceeds AGREEMENT."""
    runs = []
    for path in (first_path, second_path):
        with open(path) as saved:
            runs.append(json.load(saved)["results"])
    agree = True
    print(f"first run: {first_path}; second run: {second_path}")
    print(f"{'model':<12}{'ratio':<10}{'first run':>10}{'second run':>12}  difference")
    for model in runs[0]:
        if model not in runs[1]:
            continue
        for name, ratio in runs[0][model]["analysis"]["ratios"].items():
            first, second = ratio["median"], runs[1][model]["analysis"]["ratios"][name]["median"]
            difference = abs(second / first - 1)
            agree &= difference <= AGREEMENT
            numerator, denominator = name.split("/", 1)
            print(f"{model:<12}{f'({numerator})/({denominator})':<10}{first:>10.3f}{second:>12.3f}  {difference * 100:>9.1f}%"
                  + ("" if difference <= AGREEMENT else f"  more than {AGREEMENT:.0%} apart"))
    print(f"The runs {'agree' if agree else 'do NOT agree'} within {AGREEMENT:.0%} on every ratio.")
    return agree


def plot(results, path):
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'tarantella[plot]' (or pip install matplotlib).")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(results)
    figure, axes = plt.subplots(2, len(models), figsize=(3.2 * len(models), 6), squeeze=False)
    for column, model in enumerate(models):
        steps = results[model]["analysis"]["step_seconds"]
        batch = results[model]["measured"]["global_batch_size"]
        labels = list(steps)
        medians = [steps[label]["median"] for label in labels]
        for row, (values, low_high, unit) in enumerate([
                ([m * 1e3 for m in medians], [(steps[l]["q1"] * 1e3, steps[l]["q3"] * 1e3) for l in labels],
                 "step time (ms)"),
                ([batch / m for m in medians], [(batch / steps[l]["q3"], batch / steps[l]["q1"]) for l in labels],
                 "samples/s")]):
            errors = [[v - low for v, (low, _) in zip(values, low_high)],
                      [high - v for v, (_, high) in zip(values, low_high)]]
            axis = axes[row][column]
            axis.bar(labels, values, yerr=errors, capsize=3, color="tab:blue" if row == 0 else "tab:green")
            axis.set_ylabel(unit)
            if row == 0:
                axis.set_title(f"{model} (batch {batch})")
    described = {label: spec["description"] for result in results.values()
                 for label, spec in result["measured"]["variants"].items()}
    figure.text(0.5, 0.005, "  ".join(f"({label}) {description}" for label, description in described.items()),
                ha="center", fontsize=7)
    figure.suptitle("Median step time and samples/s; bars: interquartile range over rounds")
    figure.tight_layout(rect=(0, 0.03, 1, 0.96))
    figure.savefig(path, dpi=120)
    print(f"Plot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--repeats", type=int, help=f"interleaved rounds of windows (default {DEFAULT_REPEATS})")
    parser.add_argument("--steps", type=int, help="timed steps per window (default: " +
                        ", ".join(f"{model} {steps}" for model, steps in STEPS_PER_WINDOW.items()) + ")")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test: {QUICK['repeats']} rounds of {QUICK['steps']}-step windows; "
                             "the numbers mean nothing")
    parser.add_argument("--plot", metavar="FILE.png", help="draw step time and samples/s (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE.json", help="write every measurement and the summary")
    parser.add_argument("--against", metavar="REV[,REV...]",
                        help="also time tarantella as it was at these git revisions (2 ranks each), in the same "
                             f"rounds, and judge (c)/(@REV) <= {AGAINST_TARGET:.2f}; run it before merging a "
                             "change to the step, the communicator or the launcher")
    parser.add_argument("--variants", metavar="LABELS",
                        help="time only these variants, e.g. c,@main (default: all of each model's)")
    parser.add_argument("--compare", nargs=2, metavar="FILE.json",
                        help="measure nothing: check that two --json runs agree within 5%% on every ratio")
    args = parser.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    models = args.models.split(",")
    unknown = [model for model in models if model not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    repeats = args.repeats or (QUICK["repeats"] if args.quick else DEFAULT_REPEATS)
    if repeats < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--repeats and --steps must be at least 1")
    if args.plot:  # fail now, not after the measurement
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'tarantella[plot]' (or pip install matplotlib).")
    warmup = QUICK["warmup"] if args.quick else WARMUP_STEPS

    started = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(prefix="tnt-scaling-") as scratch:
        revisions = against_variants(args.against.split(","), scratch) if args.against else {}
        try:
            for model in models:
                ablations = [label for label in VARIANTS if label.startswith("no-")]
                variants = {label: (*VARIANTS[label], None) for label in MODEL_VARIANTS[model] + ablations}
                variants.update(revisions)
                chosen = args.variants.split(",") if args.variants else \
                    [label for label in variants if label not in ablations]
                unknown = [label for label in chosen if label not in variants]
                if unknown:
                    parser.error(f"unknown variant(s) {', '.join(unknown)} for {model}; choose from "
                                 f"{', '.join(variants)}")
                variants = {label: spec for label, spec in variants.items() if label in chosen}
                steps = args.steps or (QUICK["steps"] if args.quick else STEPS_PER_WINDOW[model])
                try:
                    measured = measure_model(model, variants, repeats, steps, warmup, scratch)
                except WorkerFailed as error:
                    sys.exit(f"benchmark failed: {error}")
                results[model] = {"measured": measured, "analysis": analyze(model, measured)}
        finally:
            remove_worktrees(revisions)
    print_report(results, repeats)
    print(f"Whole run: {time.monotonic() - started:.0f} s (" + ", ".join(
        f"{model} {result['measured']['seconds']:.0f} s, of which start-up {result['measured']['start_seconds']:.0f} s"
        for model, result in results.items()) + ").")
    if args.quick:
        print("--quick: a smoke test; these numbers judge nothing.")
    if args.json:
        with open(args.json, "w") as output:
            json.dump({"repeats": repeats, "results": results}, output, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
