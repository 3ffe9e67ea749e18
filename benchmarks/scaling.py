"""Data-parallel scaling of tarantella on one node, robust to a noisy machine.

For each model (LeNet-5; an MLP of about 10M parameters; ResNet-50 at 32x32 inputs; a small
Transformer encoder with masked attention and sparse embedding gradients) it measures the
master rank's training-step time and samples/s of:
  (a) plain Keras in one process, tarantella not imported;
  (b) tarantella at 1 rank, where tnt.Model is plain Keras;
  (c) tarantella at 2 ranks;
  (d) 2 ranks with the gradient allreduce monkeypatched away: the compute-only ceiling;
  (e) ResNet-50 only: 2 ranks with synchronized BatchNormalization;
  (ring) with (c) and (d): the bare ring allreduce (mpi4py) of the model's gradient bytes over
      (c)'s two ranks, timed in every round: (d) + (ring) is what a 2-rank step costs at best on
      this machine, where the allreduce cannot hide behind compute (the ranks share its cores);
  (timeline) named in --variants only: (c) recording its timeline (tarantella --timeline);
  (@REV) with --against REV: tarantella as it was at git revision REV, at 2 ranks (a git
      worktree of REV, imported by the same Python and packages; the worker is this one), on
      every backend;
  (horovod) LeNet-5 and the MLP only: Horovod 0.28.1 at 2 ranks, on TensorFlow 2.15 and
      Keras 2, from the environment that benchmarks/make_horovod_venv.sh builds (--horovod-venv;
      skipped, with a line saying so, where there is none), under the same launcher and mpiexec;
  (a+NAME=VALUE), (c+NAME=VALUE), (d+NAME=VALUE) named in --variants only: (a), (c) or (d)
      with one environment setting, e.g. c+TNT_FUSION_THRESHOLD=1024, or a+BENCHMARK_JIT_COMPILE=1
      and c+BENCHMARK_JIT_COMPILE=1 for XLA (compile(jit_compile=True)), reported against (a),
      (c) or (d), and (c+S)/(d+S);
  (split), (keras2), (keras2-split) named in --variants only, to find where a gap to Horovod
      comes from: Keras 3 at 2 processes each training its half of every global batch with no
      communication at all; Keras 2 in one process, and Keras 2 split as (split), both from
      Horovod's environment without Horovod;
and judges the step-time ratios (b)/(a), (c)/(d), (c)/((d)+(ring)), (e)/(c), (timeline)/(c),
(c)/(@REV) and (c)/(horovod) against their targets: this code may not be slower than REV. It also counts tarantella's agreement
allreduces per step (one opens each step; there is no switch) and times one.

Every variant trains the same model from the same seed on the same random data (SGD,
sparse categorical cross-entropy, accuracy; with BENCHMARK_GRADIENT_ACCUMULATION_STEPS=k in the
environment, SGD accumulates k micro-steps per update, in every variant). How noise is kept out:
- All variants of one model start together (benchmarks/scaling_worker.py) and stay alive;
  after tracing, each waits, taking no CPU, until told to run one timed window of a few
  steps. Only one variant runs at a time. Horovod's background thread runs a collective
  every millisecond even while its program waits, so its job is stopped (SIGSTOP) between
  windows.
- A round runs one window of every variant, in the order a, b, c, d (, e), the next round
  in reverse, and so on, so drift of the machine's speed hits all variants alike.
- With --against (or --process-sets K), the rounds are split among K sets of fresh processes, one
  set after another: what a process draws at start (its memory layout, its core) biases all its
  windows alike, and only new processes let that bias show in the spread.
- A window's step time is the median of its steps; a ratio is computed per round, from
  windows run moments apart, and reported as the median over rounds with its spread (the
  interquartile range, and min-max). A target is judged only when the whole interquartile
  range lies on one side of it; otherwise the output says the spread is too large to judge.
Compare numbers within one invocation only, on a quiet machine.

--backend jax or torch runs the workers on that Keras backend (KERAS_BACKEND): LeNet-5 and the
MLP, variants (a)-(d), (split) and (ring); (d) patches that backend's step to apply each rank's own
gradients. Several, e.g. --backend tensorflow,jax, are measured one after another, and each
model's (c)/(d) on the other backend is judged against TensorFlow's times 1.10: met only where its
interquartile range lies wholly below 1.10 times the lower quartile of TensorFlow's.

    python benchmarks/scaling.py [--backend tensorflow|jax|torch[,...]] [--models lenet5,mlp,resnet50,transformer] [--repeats 12]
        [--steps N] [--quick] [--plot FILE.png] [--json FILE.json]
        [--against REV[,REV...]] [--variants a,b,c,d,e,@REV,horovod,split,keras2,keras2-split,...] [--horovod-venv DIR]
    python benchmarks/scaling.py --compare FIRST.json SECOND.json
"""

import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_worker.py")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # --against checks revisions out of it
DEFAULT_REPEATS = 12
WARMUP_STEPS = 3
# Timed steps per window: about 0.2-1 s of work per window on 2 cores.
STEPS_PER_WINDOW = {"lenet5": 40, "mlp": 8, "resnet50": 2, "transformer": 3}
AGREEMENT = 0.05  # two runs on a quiet machine should give every ratio within 5% of each other
MIN_ROUNDS_TO_JUDGE = 5
# Fresh processes for each quarter of an --against run's rounds: two runs of identical code, each with
# one set of processes, put their medians 1-2% apart with tight quartiles (2026-11).
DEFAULT_PROCESS_SETS = 4  # fewer give no meaningful quartiles
QUICK = {"repeats": 2, "steps": 2, "warmup": 2}
START_TIMEOUT_S = 600  # all variants of a model start and trace together on a small machine
WINDOW_TIMEOUT_S = 300
FINISH_TIMEOUT_S = 60  # after the last window; a Horovod job has taken minutes to shut down
DEFAULT_HOROVOD_VENV = os.path.join(REPOSITORY, ".venv-horovod")


class Variant(NamedTuple):
    description: str
    ranks: int
    worker_variant: str  # scaling_worker.py --variant
    tarantella_folder: str = None  # import tarantella from this checkout (--against), not the installed one
    python: str = None  # the ranks' interpreter, where not this one
    stop_between_windows: bool = False  # for a job that uses CPU while it waits
    environment: tuple = ()  # (name, value) settings for the ranks


VARIANTS = {
    "a": Variant("plain Keras, 1 process", 1, "keras"),
    "b": Variant("tarantella, 1 rank", 1, "tarantella"),
    "c": Variant("tarantella, 2 ranks", 2, "tarantella"),
    "d": Variant("2 ranks, no gradient allreduce", 2, "no-allreduce"),
    "e": Variant("2 ranks, synchronized BatchNorm", 2, "sync-bn"),
    # Ablations, timed only when named in --variants: what each safety mechanism costs.
    "no-agreement": Variant("2 ranks, no agreement allreduce", 2, "no-agreement"),
    "no-monitor": Variant("2 ranks, no peer monitor", 2, "no-monitor"),
    "no-agreement-no-monitor": Variant("2 ranks, neither", 2, "no-agreement-no-monitor"),
    # What recording the timeline costs, timed only when named in --variants.
    "timeline": Variant("2 ranks, --timeline", 2, "timeline"),
    # Keras alone at 2 processes, each training its half of every global batch with no
    # communication at all: what (d) costs beyond Keras's own step. Timed only when named.
    "split": Variant("Keras, 2 processes, no communication", 2, "split"),
    # Their interpreter comes from --horovod-venv.
    "horovod": Variant("Horovod (Keras 2), 2 ranks", 2, "horovod", stop_between_windows=True),
    # Horovod's baselines: Keras 2 in one process, and at 2 processes without communication.
    "keras2": Variant("plain Keras 2, 1 process", 1, "keras"),
    "keras2-split": Variant("Keras 2, 2 processes, no communication", 2, "split"),
}
HOROVOD_ENVIRONMENT = ("horovod", "keras2", "keras2-split")
# Upper bounds on step-time ratios (numerator, denominator; "d+ring" is the sum of both per
# round): what tarantella costs at one rank, what the gradient allreduce costs at two, the
# 2-rank step against the machine's limit (compute plus a bare ring allreduce, issue 22), what
# synchronized BatchNormalization adds, what the timeline costs, and how tarantella's 2-rank
# step compares with Horovod's (issue 24).
TIMELINE_TARGET = 1.03
RATIO_TARGETS = {
    "lenet5": {("b", "a"): 1.02, ("c", "d"): 1.08, ("c", "d+ring"): 1.05, ("c", "horovod"): 0.95},
    "mlp": {("b", "a"): 1.02, ("c", "d"): 1.25, ("c", "d+ring"): 1.03, ("c", "horovod"): 0.90},
    "resnet50": {("b", "a"): 1.02, ("c", "d"): 1.10, ("c", "d+ring"): 1.03, ("e", "c"): 1.15},
    "transformer": {("b", "a"): 1.02, ("c", "d"): 1.10, ("c", "d+ring"): 1.05},
}
RING = "bare ring allreduce (mpi4py), 2 ranks"
MODELS = list(RATIO_TARGETS)
MODEL_VARIANTS = {model: list("abcde" if model == "resnet50" else "abcd") for model in MODELS}
for model in ("lenet5", "mlp"):  # the worker's other models need Keras 3
    MODEL_VARIANTS[model].append("horovod")
# Reported, not judged, where their variants ran: where a gap to Horovod comes from. Each tool's
# communication against its own Keras without any (horovod/keras2-split, c/split); tarantella's
# step beyond Keras's at 2 ranks (d/split); Keras 3's step against Keras 2's (a/keras2, split/keras2-split).
DECOMPOSITION = {("horovod", "keras2-split"): None, ("c", "split"): None, ("d", "split"): None,
                 ("a", "keras2"): None, ("split", "keras2-split"): None}
# (c)/(@REV): the code under test against an earlier revision of itself.
AGAINST_TARGET = 1.00
# Keras backends (--backend). On JAX and PyTorch: LeNet-5 and the MLP, and the variants that
# have a meaning there (Horovod, Keras 2, synchronized BatchNormalization, older revisions, the
# TensorFlow step's ablations and timeline stay TensorFlow's).
BACKENDS = ("tensorflow", "jax", "torch")
OTHER_BACKEND_MODELS = ("lenet5", "mlp")
OTHER_BACKEND_VARIANTS = ("a", "b", "c", "d", "split")
# A backend's (c)/(d) against TensorFlow's on the same model, measured in the same invocation.
BACKEND_TARGET = 1.10


def against_variants(revisions, scratch):
    """label -> Variant per revision, each checked out into a git worktree of its own under
    `scratch` (removed with it)."""
    variants = {}
    for revision in revisions:
        folder = os.path.join(scratch, f"revision-{len(variants)}")
        subprocess.run(["git", "-C", REPOSITORY, "worktree", "add", "--detach", "--quiet", folder, revision],
                       check=True)
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        variants[f"@{revision}"] = Variant(f"tarantella at {commit}, 2 ranks", 2, "tarantella",
                                           tarantella_folder=folder)
    return variants


def remove_worktrees(variants):
    for variant in variants.values():
        subprocess.run(["git", "-C", REPOSITORY, "worktree", "remove", "--force", variant.tarantella_folder],
                       check=False)


def horovod_python(venv):
    """The Python of `venv`, which runs the variants of Horovod's environment, or None where Horovod
    is not built there."""
    if not os.access(os.path.join(venv, "bin", "horovodrun"), os.X_OK):  # installed with Horovod
        return None
    return os.path.join(venv, "bin", "python")


def horovod_missing(venv):
    """Where Horovod was looked for, and the command that builds it there."""
    script = os.path.relpath(os.path.join(REPOSITORY, "benchmarks", "make_horovod_venv.sh"))
    command = f"bash {script}" + ("" if venv == DEFAULT_HOROVOD_VENV else f" {venv}")
    return f"no Horovod environment at {venv}; build it with: {command}"


def horovod_skipped(models, named, horovod_python, venv):
    """The line that says a run of every variant leaves (horovod) out, or None where it does not."""
    if horovod_python is None and named is None and any("horovod" in MODEL_VARIANTS[model] for model in models):
        return f"horovod variant skipped: {horovod_missing(venv)}"
    return None


def setting_variant(label):
    """The variant `a+NAME=VALUE`, `c+NAME=VALUE` or `d+NAME=VALUE`: (a), (c) or (d) with the
    environment setting NAME=VALUE (e.g. c+TNT_FUSION_THRESHOLD=1024), or None where `label` is no
    such name."""
    base, plus, setting = label.partition("+")
    name, equals, value = setting.partition("=")
    if base not in ("a", "c", "d") or not plus or not equals or not name.isidentifier():
        return None
    return VARIANTS[base]._replace(description=f"{VARIANTS[base].description}, {name}={value}",
                                   environment=((name, value),))


def backend_models(backend):
    return MODELS if backend == "tensorflow" else list(OTHER_BACKEND_MODELS)


def select_variants(model, named, revisions, horovod_python, horovod_venv, backend="tensorflow"):
    """{label: Variant} to time for `model`: those `named` (None: the model's own, without the
    ablations and baselines timed only when named) plus the revisions', on Keras' `backend`.
    Raises ValueError for a name it cannot time."""
    if backend != "tensorflow":
        return select_other_backend_variants(model, named, revisions, backend)
    when_named = [label for label in VARIANTS if label.startswith("no-") or label in ("timeline", "split")]
    if "horovod" in MODEL_VARIANTS[model]:
        when_named += [label for label in HOROVOD_ENVIRONMENT if label != "horovod"]
    variants = {label: VARIANTS[label] for label in MODEL_VARIANTS[model] + when_named}
    variants.update(revisions)
    if named is None:
        named = [label for label in variants if label not in when_named]
        if horovod_python is None:
            named = [label for label in named if label != "horovod"]
    for label in named:
        setting = setting_variant(label)
        if setting is not None:
            variants[label] = setting
    unknown = [label for label in named if label not in variants]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)} for {model}; choose from {', '.join(variants)}")
    for label in HOROVOD_ENVIRONMENT:
        if label in named:
            if horovod_python is None:
                raise ValueError(f"cannot time {label}: {horovod_missing(horovod_venv)}")
            variants[label] = variants[label]._replace(python=horovod_python)
    return {label: variant for label, variant in variants.items() if label in named}


def select_other_backend_variants(model, named, revisions, backend):
    """select_variants on Keras' JAX or PyTorch backend: the workers run with KERAS_BACKEND set."""
    if model not in OTHER_BACKEND_MODELS:
        raise ValueError(f"{model} is timed on the TensorFlow backend only; on {backend}: "
                         f"{', '.join(OTHER_BACKEND_MODELS)}")
    labels = named if named is not None else [label for label in OTHER_BACKEND_VARIANTS if label != "split"]
    labels = labels + [label for label in revisions if label not in labels]
    variants = {}
    for label in labels:
        variant = (revisions.get(label) or VARIANTS.get(label) if label in OTHER_BACKEND_VARIANTS + ("timeline",)
                   or label in revisions else setting_variant(label))
        if variant is None:
            raise ValueError(f"variant {label} is TensorFlow-only or unknown; on {backend} choose from "
                             f"{', '.join(OTHER_BACKEND_VARIANTS)}, timeline, @REV or a+, c+ or d+NAME=VALUE")
        variants[label] = variant._replace(environment=variant.environment + (("KERAS_BACKEND", backend),))
    return variants


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One variant's worker process (or 2-rank job), driven through FIFOs."""

    def __init__(self, model, label, variant, windows, steps, warmup, scratch):
        self.name = f"{model} ({label}) {variant.description}"
        self.control = os.path.join(scratch, f"{model}-{re.sub(r'[^A-Za-z0-9_.-]', '-', label)}")
        os.mkdir(self.control)
        # Opened read-write, so that neither side blocks in open() and a reader never sees EOF.
        self._go = []
        for rank in range(variant.ranks):
            path = os.path.join(self.control, f"go-{rank}")
            os.mkfifo(path)
            self._go.append(os.open(path, os.O_RDWR))
        os.mkfifo(os.path.join(self.control, "results"))
        self._results = os.open(os.path.join(self.control, "results"), os.O_RDWR | os.O_NONBLOCK)
        self._received = b""
        self._stop_between_windows = variant.stop_between_windows
        self._rank_pids = []  # named by the ready message: each rank runs in a session of its own
        if variant.ranks == 1:
            prefix = [variant.python or sys.executable]
        else:
            prefix = [sys.executable, "-m", "tarantella.launcher", "-n", str(variant.ranks)]
            prefix += ["--python-interpreter", variant.python] if variant.python else []
            prefix += ["--"]
        self.command = prefix + [WORKER, "--model", model, "--variant", variant.worker_variant,
                                 "--windows", str(windows),
                                 "--steps-per-window", str(steps), "--warmup-steps", str(warmup),
                                 "--control", self.control]
        self._log_path = os.path.join(self.control, "output.log")
        environment = {**os.environ, **dict(variant.environment)}
        if variant.tarantella_folder is not None:  # the launcher and the ranks import that revision's tarantella
            environment["PYTHONPATH"] = os.pathsep.join(
                filter(None, [variant.tarantella_folder, os.environ.get("PYTHONPATH")]))
        with open(self._log_path, "w") as log:
            # A session of its own, so that stop() ends the launcher and its ranks together. In the
            # control folder, not the repository: `-m` and the ranks put the working folder first
            # on the path, where the repository's tarantella would hide a revision's.
            self._process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=environment, cwd=self.control)

    def send(self, command):
        self._signal_ranks(signal.SIGCONT)
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
        message = json.loads(line)
        if self._stop_between_windows:  # the master rank answered: the job waits for the next command
            self._rank_pids = message.get("rank_pids", self._rank_pids)
            self._signal_ranks(signal.SIGSTOP)
        return message

    def _signal_ranks(self, signum):
        if self._stop_between_windows:
            for pid in self._rank_pids:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:  # ended: its job failed, which receive() reports
                    pass

    def finish(self, timeout_s):
        """Waits for the worker to end after "end"; returns None, or why it did not end well. Its
        windows are measured already, so that is reported, not fatal."""
        try:
            status = self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return f"{self.name} did not end within {timeout_s} s of its last window; stopped"
        if status != 0:
            return f"{self.name} ended with exit status {status} after its last window"
        return None

    def stop(self):
        self._signal_ranks(signal.SIGCONT)  # a stopped rank would not act on SIGTERM from its MPI launcher
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        for fd in self._go + [self._results]:
            os.close(fd)

    def log_tail(self):
        with open(self._log_path, errors="replace") as log:
            return log.read()[-5000:]


def measure_model(model, variants, repeats, steps, warmup, scratch, process_sets=1):
    """Runs the `variants` ({label: Variant}) of `model` for `repeats` interleaved rounds; returns the raw
    results. The rounds are split among `process_sets` sets of fresh worker processes, one set after
    another: a process keeps for its life what it drew at start (where its memory lies, which core it
    settled on), which shifts every window of that process alike; with several sets that bias varies
    between rounds and widens the spread, instead of shifting the median unseen."""
    labels = list(variants)
    started = time.monotonic()
    windows = {label: [] for label in labels}
    start_seconds = 0.0
    agreement = ready = None
    sets = min(process_sets, repeats)
    for index in range(sets):
        rounds = range(repeats * index // sets, repeats * (index + 1) // sets)
        ready, agreement, seconds = _run_process_set(model, variants, rounds, repeats, steps, warmup,
                                                     os.path.join(scratch, f"{model}-set{index}"), windows)
        start_seconds += seconds
    first = ready[labels[0]]
    described = {label: {"description": variant.description, "ranks": variant.ranks}
                 for label, variant in variants.items()}
    if "ring" in windows:
        described["ring"] = {"description": RING, "ranks": 2}
    return {"parameters": first["parameters"], "global_batch_size": first["global_batch_size"],
            "steps_per_window": steps, "process_sets": sets, "start_seconds": start_seconds,
            "seconds": time.monotonic() - started, "windows": windows, "agreement": agreement,
            "variants": described}


def _run_process_set(model, variants, rounds, repeats, steps, warmup, scratch, windows):
    """Starts one set of workers, runs `rounds` (a range of round numbers) into `windows`, ends them;
    returns their ready messages, the agreement timing and the seconds they took to start."""
    labels = list(variants)
    os.mkdir(scratch)
    started = time.monotonic()
    workers = {}
    try:
        for label in labels:
            workers[label] = Worker(model, label, variants[label], len(rounds), steps, warmup, scratch)
        ready = {label: worker.receive(START_TIMEOUT_S) for label, worker in workers.items()}
        for label, variant in variants.items():
            source = variant.tarantella_folder
            if source is not None and os.path.realpath(ready[label]["tarantella_folder"]) != os.path.realpath(source):
                raise WorkerFailed(f"{workers[label].name} imported tarantella from "
                                   f"{ready[label]['tarantella_folder']}, not from its revision's {source}.")
            if ready[label].get("foreign_modules"):
                raise WorkerFailed(f"{workers[label].name} mixed tarantella's modules: "
                                   f"{', '.join(ready[label]['foreign_modules'])} not from {ready[label]['tarantella_folder']}.")
            if ready[label]["ranks"] != variant.ranks:  # e.g. ranks that each found an MPI of their own
                raise WorkerFailed(f"{workers[label].name} runs as {ready[label]['ranks']} rank(s), not "
                                   f"{variant.ranks}.")
        start_seconds = time.monotonic() - started
        print(f"{model}: all variants traced and ready after {start_seconds:.0f} s", file=sys.stderr, flush=True)
        for repeat in rounds:
            order = labels if repeat % 2 == 0 else labels[::-1]
            for label in order:
                workers[label].send("window")
                windows[label].append(workers[label].receive(WINDOW_TIMEOUT_S))
            if "c" in workers and "d" in workers:  # the limit, moments after the windows it bounds
                workers["c"].send("ring")
                windows.setdefault("ring", []).append(workers["c"].receive(WINDOW_TIMEOUT_S))
            print(f"[{model} round {repeat + 1}/{repeats}] " + " ".join(
                f"{label} {windows[label][-1]['median_step_seconds'] * 1e3:.1f}" for label in windows) + " ms/step",
                file=sys.stderr, flush=True)
        agreement = {"agreement_seconds": None, "collective_seconds": None}
        if "c" in workers:
            workers["c"].send("agreement")
            agreement = workers["c"].receive(WINDOW_TIMEOUT_S)
        for worker in workers.values():  # all at once: one that hangs in its exit delays no other
            worker.send("end")
        for worker in workers.values():
            trouble = worker.finish(FINISH_TIMEOUT_S)
            if trouble:
                print(f"warning: {trouble} (its windows stand).\n{worker.log_tail()[-2000:]}", file=sys.stderr,
                      flush=True)
    finally:
        for worker in workers.values():
            worker.stop()
    return ready, agreement, start_seconds


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


def summands_of(denominator):
    """The variants a ratio's denominator adds up: "d+ring" is (d)+(ring), "d+NAME=VALUE" one variant."""
    return [denominator] if setting_variant(denominator) is not None else denominator.split("+")


def analyze(model, measured):
    """Step times per variant, and each target ratio from paired rounds, with their spread."""
    step = {label: [w["median_step_seconds"] for w in windows] for label, windows in measured["windows"].items()}
    ratios = {}
    targets = {**RATIO_TARGETS[model], **{("c", label): AGAINST_TARGET for label in step if label.startswith("@")},
               **{("c", label): None for label in step if label.startswith("no-")},
               ("timeline", "c"): TIMELINE_TARGET, **DECOMPOSITION,
               **{(label, label[0]): None for label in step if setting_variant(label) is not None},
               **{(label, "d" + label[1:]): None for label in step
                  if label.startswith("c+") and "d" + label[1:] in step}}
    for (numerator, denominator), target in targets.items():
        summands = summands_of(denominator)
        if numerator not in step or any(label not in step for label in summands):
            continue
        # Per round: the windows ran moments apart, so the machine's drift cancels.
        per_round = [n / sum(d) for n, *d in zip(step[numerator], *(step[label] for label in summands))]
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


def across_backends(results):
    """Per model measured on TensorFlow and another backend: that backend's (c)/(d) over TensorFlow's,
    judged against BACKEND_TARGET. The backends ran one after another, not in paired rounds, so a
    verdict needs the whole of one interquartile range on one side of the target times the other's."""
    compared = {}
    for backend, by_model in results.items():
        if backend == "tensorflow":
            continue
        for model, result in by_model.items():
            reference = results.get("tensorflow", {}).get(model, {}).get("analysis", {}).get("ratios", {}).get("c/d")
            measured = result["analysis"]["ratios"].get("c/d")
            if reference is None or measured is None:
                continue
            compared.setdefault(model, {})[backend] = {
                "c/d": measured["median"], "tensorflow_c/d": reference["median"],
                "ratio": measured["median"] / reference["median"], "target": BACKEND_TARGET,
                "verdict": backend_verdict(measured, reference, BACKEND_TARGET)}
    return compared


def backend_verdict(measured, reference, target):
    """'met' or 'MISSED' when the measured ratio's interquartile range lies wholly below or above
    `target` times the reference's."""
    if min(len(measured["per_round"]), len(reference["per_round"])) < MIN_ROUNDS_TO_JUDGE:
        return f"too few rounds to judge (fewer than {MIN_ROUNDS_TO_JUDGE})"
    if measured["q3"] <= target * reference["q1"]:
        return "met"
    if measured["q1"] > target * reference["q3"]:
        return "MISSED"
    return "spread too large to judge"


# -- output ------------------------------------------------------------------------------

def relative_spread(spread):
    median = spread["median"]
    return f"{(spread['q1'] / median - 1) * 100:+.0f}%/{(spread['q3'] / median - 1) * 100:+.0f}%"


def print_report(results, repeats, backend):
    print(f"\nKeras backend: {backend}. Median over {repeats} interleaved round(s) of each window's median step time; IQR: interquartile "
          "range relative to the median.")
    header = (f"{'model':<12}{'params':>12}  {'variant':<46}{'step ms':>9}{'IQR':>12}{'samples/s':>11}")
    print(header)
    print("-" * len(header))
    for model, result in results.items():
        measured, analysis = result["measured"], result["analysis"]
        batch = measured["global_batch_size"]
        for index, (label, spread) in enumerate(analysis["step_seconds"].items()):
            name, count = (model, f"{measured['parameters']:,}") if index == 0 else ("", "")
            description = f"({label}) {measured['variants'][label]['description']}"
            print(f"{name:<12}{count:>12}  {description:<46}{spread['median'] * 1e3:>9.2f}"
                  f"{relative_spread(spread):>12}{batch / spread['median']:>11,.0f}")
        print(f"{'':<26}global batch {batch}, {measured['steps_per_window']} timed step(s) per window")
        for name, ratio in analysis["ratios"].items():
            numerator, denominator = name.split("/", 1)
            denominator = "+".join(f"({label})" for label in summands_of(denominator))
            quartiles = f"{ratio['q1']:.3f}-{ratio['q3']:.3f}"
            print(f"{'':<26}{f'({numerator})/{denominator} step time':<46}{ratio['median']:>9.3f}"
                  f"{quartiles:>12}  min-max {ratio['min']:.3f}-{ratio['max']:.3f}, "
                  + (f"target <= {ratio['target']:.2f}: " if ratio["target"] is not None else "") + ratio["verdict"])
        speed_up = analysis["speed_up_c_over_a"]
        if speed_up is not None:
            quartiles = f"{speed_up['q1']:.2f}-{speed_up['q3']:.2f}"
            print(f"{'':<26}{'(c)/(a) speed-up in samples/s':<46}{speed_up['median']:>9.2f}{quartiles:>12}")
        print_agreement(analysis, measured)
        print()


def print_across_backends(compared):
    if not compared:
        return
    print(f"(c)/(d) per backend against TensorFlow's on the same model (target: at most {BACKEND_TARGET:.2f} "
          "times TensorFlow's, judged only where both interquartile ranges allow):")
    for model, by_backend in compared.items():
        for backend, entry in by_backend.items():
            print(f"{model:<12}{backend:<12}(c)/(d) {entry['c/d']:.3f}, TensorFlow's {entry['tensorflow_c/d']:.3f}: "
                  f"ratio {entry['ratio']:.3f}, {entry['verdict']}")
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
        line += (f".\n{'':<26}Each is a 32-byte allreduce of "
                 f"{agreement['agreement_seconds'] * 1e6:.0f} us (a whole synchronous 32-byte collective: "
                 f"{agreement['collective_seconds'] * 1e6:.0f} us); agreeing per step: {costs} of the step")
    print(line)


def compare(first_path, second_path):
    """Prints how far two runs' ratio medians lie apart, per Keras backend both measured; returns
    False if any exceeds AGREEMENT."""
    runs = []
    for path in (first_path, second_path):
        with open(path) as saved:
            run = json.load(saved)
        # Files written before --backend hold one TensorFlow run's models.
        runs.append(run["results"] if "backends" in run else {"tensorflow": run["results"]})
    agree = True
    print(f"first run: {first_path}; second run: {second_path}")
    for backend in [backend for backend in runs[0] if backend in runs[1]]:
        print(f"Keras backend: {backend}")
        print(f"{'model':<12}{'ratio':<10}{'first run':>10}{'second run':>12}  difference")
        first_models, second_models = runs[0][backend], runs[1][backend]
        for model in [model for model in first_models if model in second_models]:
            for name, ratio in first_models[model]["analysis"]["ratios"].items():
                first, second = ratio["median"], second_models[model]["analysis"]["ratios"][name]["median"]
                difference = abs(second / first - 1)
                agree &= difference <= AGREEMENT
                numerator, denominator = name.split("/", 1)
                print(f"{model:<12}{f'({numerator})/({denominator})':<10}{first:>10.3f}{second:>12.3f}  "
                      f"{difference * 100:>9.1f}%" + ("" if difference <= AGREEMENT else f"  more than {AGREEMENT:.0%} apart"))
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
    parser.add_argument("--backend", default="tensorflow", metavar="NAME[,NAME...]",
                        help=f"Keras backend(s) the workers run on, from {', '.join(BACKENDS)}, measured one after "
                             f"another (default tensorflow); with tensorflow and another, each model's (c)/(d) is "
                             f"judged against TensorFlow's times {BACKEND_TARGET:.2f}")
    parser.add_argument("--models",
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all that every named backend "
                             f"times; {', '.join(OTHER_BACKEND_MODELS)} on jax and torch)")
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
    parser.add_argument("--process-sets", type=int, metavar="K",
                        help="split the rounds among K sets of fresh worker processes, started one after "
                             "another, so that a bias a process carries for its life shows in the spread "
                             f"(default {DEFAULT_PROCESS_SETS} with --against, else 1)")
    parser.add_argument("--variants", metavar="LABELS",
                        help="time only these variants, e.g. c,@main (default: all of each model's)")
    parser.add_argument("--horovod-venv", metavar="DIR", default=DEFAULT_HOROVOD_VENV,
                        help="the environment benchmarks/make_horovod_venv.sh built, whose Python runs the "
                             "horovod variant (default: .venv-horovod in the repository)")
    parser.add_argument("--compare", nargs=2, metavar="FILE.json",
                        help="measure nothing: check that two --json runs agree within 5%% on every ratio")
    args = parser.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    backends = args.backend.split(",")
    unknown = [backend for backend in backends if backend not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    models = args.models.split(",") if args.models else [
        model for model in MODELS if all(model in backend_models(backend) for backend in backends)]
    unknown = [model for model in models if model not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    repeats = args.repeats or (QUICK["repeats"] if args.quick else DEFAULT_REPEATS)
    process_sets = args.process_sets or (DEFAULT_PROCESS_SETS if args.against else 1)
    if repeats < 1 or process_sets < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--repeats, --process-sets and --steps must be at least 1")
    if args.plot:  # fail now, not after the measurement
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'tarantella[plot]' (or pip install matplotlib).")
    warmup = QUICK["warmup"] if args.quick else WARMUP_STEPS
    named = args.variants.split(",") if args.variants else None
    horovod = horovod_python(args.horovod_venv)
    skipped = horovod_skipped(models, named, horovod, args.horovod_venv) if "tensorflow" in backends else None
    if skipped:
        print(skipped, flush=True)

    started = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(prefix="tnt-scaling-") as scratch:
        revisions = against_variants(args.against.split(","), scratch) if args.against else {}
        try:
            try:  # every model's, before any is measured
                chosen = {backend: {model: select_variants(model, named, revisions, horovod, args.horovod_venv,
                                                           backend) for model in models}
                          for backend in backends}
            except ValueError as error:
                parser.error(str(error))
            for backend, by_model in chosen.items():
                backend_scratch = os.path.join(scratch, backend)  # each backend's workers' FIFOs
                os.mkdir(backend_scratch)
                for model, variants in by_model.items():
                    steps = args.steps or (QUICK["steps"] if args.quick else STEPS_PER_WINDOW[model])
                    print(f"{model} on Keras' {backend} backend", file=sys.stderr, flush=True)
                    try:
                        measured = measure_model(model, variants, repeats, steps, warmup, backend_scratch,
                                                 process_sets)
                    except WorkerFailed as error:
                        sys.exit(f"benchmark failed on the {backend} backend: {error}")
                    results.setdefault(backend, {})[model] = {"measured": measured,
                                                              "analysis": analyze(model, measured)}
        finally:
            remove_worktrees(revisions)
    for backend, by_model in results.items():
        print_report(by_model, repeats, backend)
    compared = across_backends(results)
    print_across_backends(compared)
    print(f"Whole run: {time.monotonic() - started:.0f} s (" + ", ".join(
        f"{model} on {backend} {result['measured']['seconds']:.0f} s, of which start-up "
        f"{result['measured']['start_seconds']:.0f} s"
        for backend, by_model in results.items() for model, result in by_model.items()) + ").")
    if args.quick:
        print("--quick: a smoke test; these numbers judge nothing.")
    if args.json:
        with open(args.json, "w") as output:
            json.dump({"repeats": repeats, "backends": backends, "results": results,
                       "across_backends": compared}, output, indent=1)
    if args.plot:
        plot({model if len(results) == 1 else f"{model} ({backend})": result
              for backend, by_model in results.items() for model, result in by_model.items()}, args.plot)


if __name__ == "__main__":
    main()
