"""An emulated cluster: tarantella at 2 to 32 ranks over shaped links, on one machine.

Each host is a network namespace on one bridge (R ranks per host, --ranks-per-host), reached
by the mpich wheel's Hydra through an ssh stand-in; ranks on different hosts talk MPI over TCP
through the host's veth, which `tc ... tbf` limits in both directions to the link profile's
rate. The ranks train profile models (benchmarks/cluster/profile_model.py): the layer
structure and weight sizes of ResNet-50, the Transformer (big), BERT-base and VGG-16, each
layer's forward and backward compute replaced by a sleep of its measured time
(benchmarks/profiles/*.cpu.json, measured on this machine's CPU by the `profile` command), so
that 16-32 ranks fit on 2 cores while the gradients, tarantella's buckets, its worker thread,
the fixed order, the ring and MPI are the real ones.

Scaling: 2 cores cannot move 16 links' worth of 100 Gb/s. Every gradient's size, the fusion
thresholds, the ring's 1 MiB cut-over and every link's rate are divided by the same byte scale
(--scale, default 512), for every variant alike: the transfer time of each bucket is the
nominal one, and the machine moves 1/scale of the bytes. What is not scaled is latency: the
emulated links have the veth pair's, the bridge's and TCP's own latency (measured and printed:
tens of microseconds per message, against 1-2 us on InfiniBand), and tarantella's per-bucket
Python costs stay real. Both make the emulation pessimistic for many small buckets and large p.
There is no netem on this kernel, so no delay is added; the projection uses the nominal latency.

Variants, all in the same job and the same rounds (a round: every link profile, and on each
every variant, one window of --steps timed steps each, the order reversed every other round):
  tnt         tarantella as it is: its automatic fusion threshold for the job's ranks, hosts and link
              (tarantella measures each link profile as shaped; the rate times the byte scale is nominal)
  tnt-mpi     TNT_ALLREDUCE=mpi (MPI_Allreduce for every bucket)
  one-bucket  a fusion threshold above the model's size: one bucket, after backprop (no overlap)
  fusion-KB   fusion threshold KB KiB (nominal); --thresholds picks two (default 32, 8192)
  after-backprop  (--backend jax, named only) TNT_JAX_GRADIENT_HANDOVER=after-backprop: the buckets
              summed after the whole backprop, against `tnt`'s hand-over per bucket across hosts
  accumulate-K  (named only) tarantella with Keras' gradient_accumulation_steps=K, which sums over the
              ranks once per K micro-steps; its step is the mean over --steps micro-steps (a
              multiple of K, so every window holds whole cycles), per micro-step as `tnt`'s, which
              sums every step as every micro-step did before accumulation skipped its sums: judged
              as accumulate-K step / tnt step (below 1: fewer sums pay)
  flat        (named only; --ranks-per-host above 1) TNT_HIERARCHICAL_ALLREDUCE=off: large buckets in
              one ring over all ranks, where `tnt` sums them node by node; judged as tnt step / flat step
  wire-W      (named only) tnt.Model(gradient_wire=W), W bfloat16 or float16: the gradients travel
              in 16 bits, half the bytes; judged as wire-W step / tnt step
  compute     the same profile model as plain Keras, no communication: the compute-only step,
              efficiency's numerator
  ddp         (--backend torch) torch DDP over gloo, a peer
  keras-dp    (--backend jax) Keras' DataParallel over JAX's distributed runtime (gloo), a peer
  horovod     Horovod 0.28.1 on Keras 2, a peer: a second job on the same hosts (see Peers)
  keras2      (named only) the profile model on Keras 2 without Horovod, in Horovod's job: Keras 2's
              compute-only step
Every window also counts the bytes the hosts sent over their links (the veths' counters): per
step, times the byte scale, they are the nominal bytes a step puts on the network.
Per round: efficiency = compute step / step (same link, same round); step / limit, the limit
being the variant's own schedule's: the compute-only step plus how far the last bucket's ready
time plus its reduction on that link (measured latency, shaped rate) reaches past backprop.
Medians over rounds with the interquartile range; a target is judged only when the whole IQR
lies on one side of it (benchmarks/scaling.py's rules).

Peers: with --backend torch, the variant `ddp` is torch's DistributedDataParallel (gloo) around
the same Keras model, in the same job and rounds. The variant `horovod` is Horovod 0.28.1, which
needs Keras 2: a second job (benchmarks/cluster/horovod_worker.py, run by the Python of
--horovod-venv, which benchmarks/make_horovod_venv.sh builds) on the same hosts and links, under
the same launcher and mpiexec, started beside tarantella's and driven in the same rounds through
the same FIFO protocol; it is stopped (SIGSTOP) between its windows, as its background thread
cycles every millisecond. Its fusion threshold (128 MiB, Horovod's default) is divided by the
byte scale like tarantella's; its cycle time (1 ms) is a time and stays as it is. With --backend
jax, the variant `keras-dp` is Keras' own keras.distribution.DataParallel over JAX's distributed
runtime (CPU collectives over gloo), in the same job and rounds: the profile model's stages wait on
each process's rows, and each weight's gradient is averaged with one allreduce of its size, as
XLA averages a real layer's.

Commands:
  python benchmarks/emulated_cluster.py run [--models resnet50,transformer_big] [--ranks 2,4,8,16]
      [--links ib,10gbe] [--repeats 5] [--steps 2] [--json FILE] [--plot FILE.png] [--timeline FILE]
      [--variants tnt,...,horovod] [--horovod-venv DIR]
  python benchmarks/emulated_cluster.py links [--hosts 4]     the unshaped and shaped links' latency and rate
  python benchmarks/emulated_cluster.py profile [--models ...] [--batch 1]   per-layer times on this CPU
  python benchmarks/emulated_cluster.py project (--profile NAME|FILE | --trace TRACE.json --model-file M.keras)
      [--ranks 96,256,1024] [--link ib | --latency-us A --gbit B] [--step-seconds S]
  python benchmarks/emulated_cluster.py --compare FIRST.json SECOND.json
Needs root and iproute2 (`ip`, `tc`) for run and links; profile and project run anywhere.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cluster"))
sys.path.insert(0, HERE)

import hosts as cluster_hosts  # noqa: E402
import profile_model  # noqa: E402
import step_model  # noqa: E402
from scaling import (  # noqa: E402
    AGREEMENT, DEFAULT_HOROVOD_VENV, MIN_ROUNDS_TO_JUDGE, horovod_missing, horovod_python, summarize, verdict)

WORKER = os.path.join(HERE, "cluster", "worker.py")
HOROVOD_WORKER = os.path.join(HERE, "cluster", "horovod_worker.py")
NETPROBE = os.path.join(HERE, "cluster", "netprobe.py")
MODELS = ("resnet50", "transformer_big", "bert_base", "vgg16")
DEFAULT_SCALE = 512
DEFAULT_THRESHOLDS = (32, 8192)  # 32 KiB: tarantella's threshold on one node
PEERS = ("ddp", "keras-dp", "horovod")  # variants that are not tarantella: no fusion plan, so no limit or model of their own
# tarantella's own alternative forms: `tnt` is judged against each (its step / theirs below 1: it wins).
ALTERNATIVES = ("after-backprop", "flat")
# tarantella's own variants whose large buckets the step model sums in one flat ring.
FLAT_RING = ("tnt", "tnt-mpi", "one-bucket", "flat")
ACCUMULATE = "accumulate-"  # accumulate-K: gradient accumulation over K micro-steps, judged against `tnt`
WIRE = "wire-"  # wire-W: the gradients travel as W (bfloat16 or float16), judged against `tnt`
WIRES = ("bfloat16", "float16")
# The variants of Horovod's job (Keras 2, its own interpreter); keras2 is a baseline, not a peer.
HOROVOD_LABELS = ("horovod", "keras2")
# Horovod 0.28.1's fusion threshold (128 MiB since 0.21) in bytes, nominal: divided by the byte
# scale like tarantella's. Its cycle time (1 ms) is a time, and times are not scaled.
HOROVOD_FUSION_BYTES = 128 << 20
START_TIMEOUT_S = 900
WINDOW_TIMEOUT_S = 300
# The targets (IB profile, 16 ranks): efficiency, and the step against the own limit.
EFFICIENCY_TARGET = 0.90
LIMIT_TARGET = 1.05
PEER_TARGET = 0.95  # tarantella's step against a peer's, same model, link and p
TARGET_MODELS = ("resnet50", "transformer_big")
# Published figures set beside the projection: (ranks, speed-up or efficiency, what).
PUBLISHED = [
    ("resnet50", 96, 57 / 96, "tarantella 0.9 manual: ResNet-50 57x on 96 V100 GPUs (HPC-DA, 100 Gb/s IB)"),
    ("resnet50", 256, 62 / 256, "tarantella 0.9 manual: ResNet-50 62x on 256 CPU processes (SuperMUC-NG, OmniPath)"),
    ("transformer_big", 96, 34 / 96, "tarantella 0.9 manual: Transformer (big) 34x on 96 V100 GPUs"),
    ("resnet50", 128, 0.90, "Horovod paper (Sergeev and Del Balso 2018): ~90% on 128-512 GPUs (ResNet-101, Inception V3)"),
    ("vgg16", 128, 0.68, "Horovod paper: 68% for VGG-16"),
    ("resnet50", 256, 0.90, "Goyal et al. 2017: ~90% from 8 to 256 GPUs, ResNet-50"),
]


def log(message):
    print(message, file=sys.stderr, flush=True)


# -- the job ------------------------------------------------------------------------------

class JobFailed(RuntimeError):
    pass


class Job:
    """The tarantella job of one model at p ranks over the emulated hosts, driven through FIFOs; or,
    with `interpreter` (Horovod's environment's Python) and `worker`, Horovod's job beside it, whose
    ranks are stopped between windows (`stop_between_windows`)."""

    def __init__(self, emulated, ranks, ranks_per_host, model, variants, scale, steps, control, extra_env=(),
                 backend="tensorflow", worker=WORKER, interpreter=None, variables=(), stop_between_windows=False):
        self.control = control
        self._stop_between_windows = stop_between_windows
        self._rank_pids = []  # named by the ready message
        self._go = []
        for rank in range(ranks):
            path = os.path.join(control, f"go-{rank}")
            os.mkfifo(path)
            self._go.append(os.open(path, os.O_RDWR))
        results = os.path.join(control, "results")
        os.mkfifo(results)
        self._results = os.open(results, os.O_RDWR | os.O_NONBLOCK)
        self._received = b""
        self.log_path = os.path.join(control, "job.log")
        hostfile = emulated.hostfile
        # UCX_TLS=tcp: MPICH's UCX would otherwise move messages between the namespaces through
        # shared memory and cross-memory attach (the "hosts" share one kernel), past the shaped links.
        command = [sys.executable, "-m", "tarantella.launcher", "--hostfile", hostfile, "--no-gpu",
                   "-n", str(ranks), "-x", "UCX_TLS=tcp"]
        for name, value in variables:
            command += ["-x", f"{name}={value}"]
        if interpreter is not None:
            command += ["--python-interpreter", interpreter]
        command += ["--", worker, "--profile", model, "--scale", repr(scale),
                    "--variants", ",".join(variants), "--steps", str(steps), "--control", control]
        environment = {**os.environ, **emulated.mpi_environment(), **dict(extra_env),
                       "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "TNT_COLLECTIVE_TIMEOUT": "900", "TNT_STALL_WARNING": "600",
                       "TNT_START_TIMEOUT": "600", "PYTHONPATH": os.pathsep.join(
                           filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))}
        self.command = command
        with open(self.log_path, "w") as output:
            self._process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                             start_new_session=True, env=environment)

    def send(self, line):
        self._signal_ranks(signal.SIGCONT)
        for fifo in self._go:
            os.write(fifo, f"{line}\n".encode())

    def receive(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._received:
            if self._process.poll() is not None:
                raise JobFailed(f"the job ended (exit status {self._process.returncode}).\n{self.tail()}")
            if time.monotonic() > deadline:
                raise JobFailed(f"no answer within {timeout_s} s.\n{self.tail()}")
            if select.select([self._results], [], [], 0.5)[0]:
                self._received += os.read(self._results, 1 << 16)
        line, self._received = self._received.split(b"\n", 1)
        message = json.loads(line)
        if self._stop_between_windows:  # the master answered after its ranks' last collective
            self._rank_pids = message.get("rank_pids", self._rank_pids)
            self._signal_ranks(signal.SIGSTOP)
        return message

    def _signal_ranks(self, signum):
        if not self._stop_between_windows:
            return
        for pid in self._rank_pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def finish(self, timeout_s=120):
        self.send("end")
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def stop(self):
        self._signal_ranks(signal.SIGCONT)
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        for fd in self._go + [self._results]:
            os.close(fd)

    def tail(self):
        with open(self.log_path, errors="replace") as output:
            return output.read()[-4000:]


def variant_labels(thresholds):
    return ["tnt", "tnt-mpi", "one-bucket"] + [f"fusion-{kb:g}" for kb in thresholds] + ["compute"]


def horovod_job(emulated, ranks, ranks_per_host, model, labels, scale, steps, control, interpreter):
    """Horovod's job beside tarantella's (same hosts, links and launcher), started and ready:
    (job, its ready message). Raises JobFailed where Horovod did not average the gradients."""
    control = os.path.join(control, "horovod")
    os.mkdir(control)
    variables = [("HOROVOD_FUSION_THRESHOLD", str(max(1, int(HOROVOD_FUSION_BYTES / scale))))]
    job = Job(emulated, ranks, ranks_per_host, model, labels, scale, steps, control, worker=HOROVOD_WORKER,
              interpreter=interpreter, variables=variables, stop_between_windows=True)
    try:
        ready = job.receive(START_TIMEOUT_S)
        if ready["ranks"] != ranks:
            raise JobFailed(f"Horovod's job runs {ready['ranks']} ranks, not {ranks}")
        check = ready["allreduce_check"]
        if check is not None and not check["ok"]:
            raise JobFailed(f"Horovod did not average the gradients: {check}\n{job.tail()}")
    except BaseException:
        job.stop()
        raise
    return job, ready


def measure(model, ranks, ranks_per_host, links, labels, scale, repeats, steps, scratch, timeline=None,
            backend="tensorflow", horovod_interpreter=None):
    """Every window of one model at `ranks` ranks: {link: {label: [window, ...]}}, the probes and the
    jobs' facts. Horovod's labels go to a job of their own, started after tarantella's is ready."""
    hosts_count = max(2, -(-ranks // ranks_per_host))
    control = tempfile.mkdtemp(prefix=f"{model}-{ranks}-", dir=scratch)
    started = time.monotonic()
    horovod_labels = [label for label in labels if label in HOROVOD_LABELS]
    with cluster_hosts.EmulatedHosts(hosts_count, control) as emulated:
        extra = [("TNT_TIMELINE", timeline)] if timeline else []
        job = Job(emulated, ranks, ranks_per_host, model, [label for label in labels if label not in HOROVOD_LABELS],
                  scale, steps, control, extra, backend)
        runners, horovod = [job], None  # the jobs; Horovod's ready message
        try:
            ready = job.receive(START_TIMEOUT_S)
            if ready["ranks"] != ranks:
                raise JobFailed(f"the job runs {ready['ranks']} ranks, not {ranks}")
            start_s = time.monotonic() - started
            log(f"{model} at {ranks} ranks on {len(ready['hosts'])} hosts: ready after {start_s:.0f} s")
            if horovod_labels:
                horovod_runner, horovod = horovod_job(emulated, ranks, ranks_per_host, model, horovod_labels, scale,
                                                      steps, control, horovod_interpreter)
                runners.append(horovod_runner)
                horovod["start_seconds"] = time.monotonic() - started - start_s
                check = horovod["allreduce_check"]
                log(f"Horovod's job ready after {horovod['start_seconds']:.0f} s more"
                    + ("" if check is None else f"; gradients averaged: local {check['local_gradients']}, "
                       f"every rank's weight {check['weights'][0]:.4g} (expected {check['expected_weight']:.4g})"))
            probes, windows = {}, {link: {label: [] for label in labels} for link in links}
            for link in links:
                emulated.shape(cluster_hosts.PROFILES[link].shaped_rate_bit(scale))
                job.send(f"probe {link}")
                probes[link] = job.receive(START_TIMEOUT_S)  # builds the models of the link's threshold
            for repeat in range(repeats):
                link_order = links if repeat % 2 == 0 else links[::-1]
                for link in link_order:
                    emulated.shape(cluster_hosts.PROFILES[link].shaped_rate_bit(scale))
                    job.send(f"link {link}")
                    job.receive(WINDOW_TIMEOUT_S)
                    for label in (labels if repeat % 2 == 0 else labels[::-1]):
                        runner = runners[-1] if label in HOROVOD_LABELS else job
                        sent_before = emulated.bytes_sent()
                        runner.send(f"window {label}")
                        window = runner.receive(WINDOW_TIMEOUT_S)
                        window["link_bytes_per_step"] = (emulated.bytes_sent() - sent_before) / (1 + steps)
                        if "unavailable" in window:
                            raise JobFailed(f"{label}: {window['unavailable']}")
                        if window.get("weights_agree") is False:
                            raise JobFailed(f"{label}: the ranks' weights differ after a window")
                        windows[link][label].append(window)
                log(f"[{model} p={ranks} round {repeat + 1}/{repeats}] " + "; ".join(
                    f"{link}: " + " ".join(f"{label} {windows[link][label][-1]['median_step_seconds'] * 1e3:.0f}"
                                           for label in labels) for link in links) + " ms")
            for runner in runners:
                runner.finish()
        finally:
            for runner in runners:
                runner.stop()
    facts = {"windows": windows, "probes": probes, "hosts": len(ready["hosts"]), "start_seconds": start_s,
             "backend": ready.get("backend"), "by_node": ready.get("by_node"),
             "seconds": time.monotonic() - started}
    if horovod is not None:
        facts["horovod"] = {key: horovod[key] for key in ("allreduce_check", "fusion_threshold_bytes", "cycle_time_ms",
                                                          "versions", "start_seconds", "hosts")}
    return facts


# -- analysis -----------------------------------------------------------------------------

def threshold_bytes_of(label, measured, link, scale):
    """A variant's fusion threshold on `link`, scaled. (Runs saved before tarantella measured its
    links have one set of thresholds for all links.)"""
    thresholds_kb = measured["probes"][link].get("thresholds_kb") or measured["thresholds_kb"]
    return int(thresholds_kb[label if label not in ("tnt-mpi", "flat") else "tnt"] / scale * 1024)


def link_parameters(probe, link, scale):
    """(alpha for MPI's own algorithms, alpha per ring step, beta in bytes/s) as the emulated link has them."""
    rate = cluster_hosts.PROFILES[link].shaped_rate_bit(scale) / 8
    return probe["allreduce_8_bytes_s"], probe["sendrecv_s"], rate


def analyze(model, ranks, measured, scale):
    """Per link and variant: step, efficiency, limit, modelled step; per round where pairs are needed."""
    profile = profile_model.load(model)
    stages = profile_model.stages(profile)
    out = {}
    for link, by_label in measured["windows"].items():
        alpha_mpi, alpha_ring, beta = link_parameters(measured["probes"][link], link, scale)
        alpha_mpi /= max(1, step_model.log2_steps(ranks))
        compute = [w["median_step_seconds"] for w in by_label["compute"]]
        entry = {}
        for label, windows in by_label.items():
            steps = [w["median_step_seconds"] for w in windows]
            row = {"step": summarize(steps), "per_round": steps}
            cpu = [w.get("cpu_seconds_per_step") for w in windows]
            if None not in cpu:  # the master's CPU time per step, times p ranks, over the machine's cores
                row["machine_busy"] = statistics.median(c * ranks / (os.cpu_count() * t) for c, t in zip(cpu, steps))
            sent = [w.get("link_bytes_per_step") for w in windows]
            if None not in sent:
                row["nominal_link_bytes_per_step"] = statistics.median(sent) * scale
            # The step model knows float32 buckets summed every step in one flat ring: no schedule to model
            # for the rest.
            summed_by_node = measured.get("by_node") and label != "flat" and (
                label in FLAT_RING or label.startswith("fusion-"))
            if label in PEERS or label in HOROVOD_LABELS or label.startswith((ACCUMULATE, WIRE)) or summed_by_node:
                row.update(efficiency=summarize([c / s for c, s in zip(compute, steps)]),
                           efficiency_per_round=[c / s for c, s in zip(compute, steps)])
            elif label != "compute":
                compute_s, buckets = step_model.schedule(
                    stages, threshold_bytes_of(label, measured, link, scale), scale)
                options = {"algorithm": "mpi" if label == "tnt-mpi" else "tarantella",
                           "ring_min_bytes": step_model.RING_MIN_BYTES / scale, "ring_alpha": alpha_ring}
                tails = [c - compute_s for c in compute]
                limits = [step_model.limit_step(compute_s, buckets, ranks, alpha_mpi, beta, t, **options) for t in tails]
                modelled = [step_model.predicted_step(compute_s, buckets, ranks, alpha_mpi, beta, t, **options)
                            for t in tails]
                row.update(
                    buckets=len(buckets),
                    efficiency=summarize([c / s for c, s in zip(compute, steps)]),
                    efficiency_per_round=[c / s for c, s in zip(compute, steps)],
                    limit=summarize(limits), limit_efficiency=summarize([c / l for c, l in zip(compute, limits)]),
                    over_limit=summarize([s / l for s, l in zip(steps, limits)]),
                    over_limit_per_round=[s / l for s, l in zip(steps, limits)],
                    modelled=summarize(modelled),
                    model_error=summarize([m / s - 1 for m, s in zip(modelled, steps)]))
            entry[label] = row
        out[link] = entry
    return out


def judge(results):
    """The issue's targets on the IB profile at 16 ranks (or the largest p measured)."""
    lines = []
    for model, by_p in results.items():
        if model not in TARGET_MODELS or "16" not in by_p or "ib" not in by_p["16"]["analysis"]:
            continue
        row = by_p["16"]["analysis"]["ib"]["tnt"]
        rounds = len(row["per_round"])
        eff = summarize(row["efficiency_per_round"])
        # Efficiency at least the target: judged on 1/efficiency against 1/target by the IQR rule.
        inverse = summarize([1 / e for e in row["efficiency_per_round"]])
        lines.append(f"{model}, ib, 16 ranks: efficiency {eff['median']:.3f} (IQR {eff['q1']:.3f}-{eff['q3']:.3f}), "
                     f"target >= {EFFICIENCY_TARGET:.2f}: {verdict(inverse, 1 / EFFICIENCY_TARGET, rounds)}")
        if "over_limit_per_round" not in row:  # summed node by node: the step model has no limit for it
            lines.append(f"{model}, ib, 16 ranks: step / own limit: no limit (the step model knows the flat ring only)")
            continue
        over = summarize(row["over_limit_per_round"])
        lines.append(f"{model}, ib, 16 ranks: step / own limit {over['median']:.3f} (IQR {over['q1']:.3f}-"
                     f"{over['q3']:.3f}), target <= {LIMIT_TARGET:.2f}: {verdict(over, LIMIT_TARGET, rounds)}")
    for model, by_p in results.items():
        for p, result in by_p.items():
            for link, rows in result["analysis"].items():
                for other, target in [(peer, PEER_TARGET) for peer in PEERS] + [(form, 1.0) for form in ALTERNATIVES]:
                    if other not in rows or "tnt" not in rows:
                        continue
                    ratios = [t / d for t, d in zip(rows["tnt"]["per_round"], rows[other]["per_round"])]
                    spread = summarize(ratios)
                    lines.append(f"{model}, {link}, {p} ranks: tnt step / {other} step {spread['median']:.3f} (IQR "
                                 f"{spread['q1']:.3f}-{spread['q3']:.3f}), target <= {target:.2f}: "
                                 f"{verdict(spread, target, len(ratios))}")
                for other in [label for label in rows if label.startswith((ACCUMULATE, WIRE)) and "tnt" in rows]:
                    ratios = [a / t for a, t in zip(rows[other]["per_round"], rows["tnt"]["per_round"])]
                    spread = summarize(ratios)
                    per = ", per micro-step" if other.startswith(ACCUMULATE) else ""
                    lines.append(f"{model}, {link}, {p} ranks: {other} step / tnt step{per} "
                                 f"{spread['median']:.3f} (IQR {spread['q1']:.3f}-{spread['q3']:.3f}), target <= 1.00: "
                                 f"{verdict(spread, 1.0, len(ratios))}")
                    if "nominal_link_bytes_per_step" in rows[other] and "nominal_link_bytes_per_step" in rows["tnt"]:
                        lines.append(f"{model}, {link}, {p} ranks: {other} bytes on the links per step / tnt's "
                                     f"{rows[other]['nominal_link_bytes_per_step'] / rows['tnt']['nominal_link_bytes_per_step']:.3f}")
    return lines


# -- output -------------------------------------------------------------------------------

def print_table(results, links, labels, file=sys.stdout):
    print("| model | p | hosts | link | variant | buckets | step ms (IQR) | efficiency (IQR) | limit ms | "
          "efficiency limit | step / limit | model error | CPU busy | MB on the links per step |", file=file)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=file)
    for model, by_p in results.items():
        for p, result in by_p.items():
            for link in links:
                for label in labels:
                    row = result["analysis"].get(link, {}).get(label)
                    if row is None:  # a merged run that did not time this variant or link
                        continue
                    step = row["step"]
                    cells = [model, p, str(result["measured"]["hosts"]), link, label, str(row.get("buckets", "")),
                             f"{step['median'] * 1e3:.0f} ({step['q1'] * 1e3:.0f}-{step['q3'] * 1e3:.0f})"]
                    if label == "compute":
                        cells += ["1", "", "", "", ""]
                    elif "limit" not in row:
                        eff = row["efficiency"]
                        cells += [f"{eff['median']:.3f} ({eff['q1']:.3f}-{eff['q3']:.3f})", "", "", "", ""]
                    else:
                        eff = row["efficiency"]
                        cells += [f"{eff['median']:.3f} ({eff['q1']:.3f}-{eff['q3']:.3f})",
                                  f"{row['limit']['median'] * 1e3:.0f}", f"{row['limit_efficiency']['median']:.3f}",
                                  f"{row['over_limit']['median']:.3f}", f"{row['model_error']['median'] * 100:+.0f}%"]
                    busy = row.get("machine_busy")
                    cells.append("" if busy is None else f"{busy:.0%}")
                    sent = row.get("nominal_link_bytes_per_step")
                    cells.append("" if sent is None else f"{sent / 1e6:.0f}")
                    print("| " + " | ".join(cells) + " |", file=file)


def print_summary(results, links, labels, file=sys.stdout):
    """The docs' table: per model, link and p, each variant's efficiency (median, IQR) and the
    compute-only step."""
    shown = [label for label in labels if label != "compute"]
    print("| model | link | p | compute-only step ms | " + " | ".join(shown) + " | CPU busy (tnt) |", file=file)
    print("|---" * (5 + len(shown)) + "|", file=file)
    for model, by_p in results.items():
        for link in links:
            for p, result in sorted(by_p.items(), key=lambda item: int(item[0])):
                rows = result["analysis"].get(link)
                if rows is None:
                    continue
                cells = [model, link, p, f"{rows['compute']['step']['median'] * 1e3:.0f}"]
                for label in shown:
                    if label not in rows:  # a merged run that did not time this variant
                        cells.append("")
                        continue
                    eff = rows[label]["efficiency"]
                    cells.append(f"{eff['median']:.2f} ({eff['q1']:.2f}-{eff['q3']:.2f})")
                busy = rows.get("tnt", {}).get("machine_busy")
                cells.append("" if busy is None else f"{busy:.0%}")
                print("| " + " | ".join(cells) + " |", file=file)


def print_model_error(results, file=sys.stdout):
    """How well the step model (the projection's) predicts the measured steps at p <= 16."""
    errors = {}
    for model, by_p in results.items():
        for p, result in by_p.items():
            for link, rows in result["analysis"].items():
                for label, row in rows.items():
                    if "model_error" in row:
                        errors.setdefault(label, []).append((abs(row["model_error"]["median"]), model, link, p,
                                                             row["model_error"]["median"]))
    if not errors:
        return
    print("\nThe step model against the measured steps (modelled / measured - 1, medians over rounds; the "
          "model is fed the measured compute-only step, the probed latency and the shaped rate):", file=file)
    for label, found in errors.items():
        worst = max(found)
        print(f"  {label}: mean |error| {statistics.mean(e[0] for e in found) * 100:.1f}% over {len(found)} "
              f"configurations, largest {worst[4] * 100:+.1f}% ({worst[1]}, {worst[2]}, p={worst[3]})", file=file)


def print_probes(results):
    print("\nThe emulated links as MPI sees them (medians; p = ranks): one 8-byte Sendrecv (a ring step's "
          "latency), an 8-byte MPI_Allreduce, and a ring allreduce of the probe's bytes:")
    for model, by_p in results.items():
        for p, result in by_p.items():
            for link, probe in result["measured"]["probes"].items():
                print(f"  {model} p={p} {link}: Sendrecv {probe['sendrecv_s'] * 1e6:.0f} us, Allreduce(8 B) "
                      f"{probe['allreduce_8_bytes_s'] * 1e6:.0f} us, ring of {probe['ring_bytes']} B "
                      + ("(no probe)" if probe["ring_s"] is None else f"{probe['ring_s'] * 1e3:.2f} ms")
                      + ("" if not probe.get("tarantella_link") else
                         f"; tarantella measured {probe['tarantella_link']['latency_us']:.0f} us and "
                         f"{probe['tarantella_link']['gbit']:.3g} Gb/s nominal, and chose a fusion threshold of "
                         f"{probe['thresholds_kb']['tnt']:g} KiB" if "tnt" in probe.get("thresholds_kb", {}) else ""))


def print_horovod(results):
    """Horovod's job per configuration: its settings and the check that it averaged the gradients."""
    lines = []
    for model, by_p in results.items():
        for p, result in by_p.items():
            facts = result["measured"].get("horovod")
            if facts is None:
                continue
            check = facts["allreduce_check"]
            lines.append(f"  {model} p={p}: Horovod {facts['versions']['horovod']} (TensorFlow "
                         f"{facts['versions']['tensorflow']}, Keras {facts['versions']['keras']}), fusion threshold "
                         f"{facts['fusion_threshold_bytes']} B, cycle time "
                         f"{facts['cycle_time_ms'] or 'default (1)'} ms, ready {facts['start_seconds']:.0f} s after "
                         "tarantella's job"
                         + ("" if check is None else f"; one step from zero: local gradients "
                            f"{', '.join(f'{g:.4g}' for g in check['local_gradients'])}, every rank's weight "
                            f"{check['weights'][0]:.4g} = -rate x their mean "
                            f"({'checked' if check['ok'] else 'NOT SO'})"))
    if lines:
        print("\nHorovod's job (the horovod variant):")
        print("\n".join(lines))


def plot(results, links, labels, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(results)
    figure, axes = plt.subplots(len(links), len(models), figsize=(max(6, 4 * len(models)), 3.3 * len(links)),
                                squeeze=False)
    for row, link in enumerate(links):
        for column, model in enumerate(models):
            axis = axes[row][column]
            ps = sorted(results[model], key=int)
            for label in labels:
                if label == "compute":
                    continue
                timed = [p for p in ps if label in results[model][p]["analysis"].get(link, {})]
                if not timed:
                    continue
                effs = [results[model][p]["analysis"][link][label]["efficiency"] for p in timed]
                axis.errorbar([int(p) for p in timed], [e["median"] for e in effs],
                              yerr=[[e["median"] - e["q1"] for e in effs], [e["q3"] - e["median"] for e in effs]],
                              marker="o", capsize=3, label=label)
            axis.set_xscale("log", base=2)
            axis.set_ylim(0, 1.05)
            axis.axhline(EFFICIENCY_TARGET, color="grey", linestyle=":", linewidth=1)
            axis.set_title(f"{model}, {link}")
            axis.set_xlabel("ranks")
            axis.set_ylabel("efficiency (compute step / step)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("Emulated cluster: efficiency (median, IQR over rounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    log(f"plot written to {path}")


# -- commands -----------------------------------------------------------------------------

def command_run(args):
    models = args.models.split(",")
    ranks = [int(p) for p in args.ranks.split(",")]
    links = args.links.split(",")
    thresholds = [float(kb) for kb in args.thresholds.split(",")] if args.thresholds else list(DEFAULT_THRESHOLDS)
    labels = variant_labels(thresholds) if not args.variants else args.variants.split(",")
    if not args.variants:  # Horovod where its environment is built, as benchmarks/scaling.py does
        if horovod_python(args.horovod_venv) is not None:
            labels.insert(labels.index("compute"), "horovod")
        else:
            log(f"horovod variant skipped: {horovod_missing(args.horovod_venv)}")
    if "compute" not in labels:
        labels.append("compute")
    for label in labels:
        if label == "flat" and args.ranks_per_host < 2:
            sys.exit("emulated_cluster: flat: with one rank per host tarantella sums flat already; give "
                     "--ranks-per-host 2 or more")
        if label.startswith(WIRE) and label[len(WIRE):] not in WIRES:
            sys.exit(f"emulated_cluster: {label}: the gradient wire must be one of {', '.join(WIRES)}, e.g. "
                     "wire-bfloat16")
        if label.startswith(ACCUMULATE):
            k = label[len(ACCUMULATE):]
            if not k.isdigit() or int(k) < 2 or args.steps % int(k):
                sys.exit(f"emulated_cluster: {label}: K must be an integer of at least 2 that divides --steps "
                         f"({args.steps}), so that every window holds whole accumulation cycles; e.g. accumulate-4 "
                         "with --steps 8")
    problem = cluster_hosts.available()
    if problem:
        sys.exit(f"emulated_cluster: {problem}")
    horovod_interpreter = None
    if any(label in HOROVOD_LABELS for label in labels):
        horovod_interpreter = horovod_python(args.horovod_venv)
        if horovod_interpreter is None:
            sys.exit(f"emulated_cluster: cannot time {', '.join(l for l in labels if l in HOROVOD_LABELS)}: "
                     f"{horovod_missing(args.horovod_venv)}")
    for name, chosen, known in (("model", models, MODELS), ("link", links, cluster_hosts.PROFILES)):
        unknown = [item for item in chosen if item not in known and not (name == "model" and item.endswith(".json")
                                                                          and os.path.exists(item))]
        if unknown:
            sys.exit(f"emulated_cluster: unknown {name}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    cluster_hosts.cleanup_stale()
    results = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tnt-cluster-") as scratch:
        os.chmod(scratch, 0o755)
        try:
            for model in models:
                for p in ranks:
                    measured = measure(model, p, args.ranks_per_host, links, labels, args.scale, args.repeats,
                                       args.steps, scratch, args.timeline if p == ranks[-1] else None,
                                       args.backend, horovod_interpreter)
                    results.setdefault(model, {})[str(p)] = {
                        "measured": measured, "analysis": analyze(model, p, measured, args.scale)}
                    if args.json:  # after every configuration: a run cut short keeps what it measured
                        save(args, links, labels, results)
        except JobFailed as error:
            sys.exit(f"emulated_cluster: {error}")
        finally:
            cluster_hosts.cleanup_stale()
    print(f"\nEmulated cluster, byte scale {args.scale:g}, {args.repeats} interleaved rounds of {args.steps}-step "
          f"windows, {args.ranks_per_host} rank(s) per host; efficiency = compute-only step / step in the "
          f"same round. {time.monotonic() - started:.0f} s.\n")
    print_table(results, links, labels)
    print("\nEfficiency per variant (compute-only step / step, median and IQR over rounds):\n")
    print_summary(results, links, labels)
    print_model_error(results)
    print_probes(results)
    print_horovod(results)
    lines = judge(results)
    if lines:
        print("\nTargets (IQR rule, at least "
              f"{MIN_ROUNDS_TO_JUDGE} rounds):\n" + "\n".join(lines))
    if args.json:
        save(args, links, labels, results)
    if args.plot:
        plot(results, links, labels, args.plot)


def save(args, links, labels, results):
    with open(args.json, "w") as output:
        json.dump({"scale": args.scale, "repeats": args.repeats, "steps": args.steps, "links": links,
                   "labels": labels, "backend": args.backend, "results": results}, output, indent=1)


def command_links(args):
    problem = cluster_hosts.available()
    if problem:
        sys.exit(f"emulated_cluster: {problem}")
    cluster_hosts.cleanup_stale()
    with tempfile.TemporaryDirectory() as directory, cluster_hosts.EmulatedHosts(args.hosts, directory) as emulated:
        servers = [subprocess.Popen(emulated.exec_in(i, [sys.executable, NETPROBE, "serve", "5555"]))
                   for i in range(args.hosts)]
        try:
            time.sleep(0.5)

            def probe(index, *arguments):
                return float(subprocess.run(emulated.exec_in(index, [sys.executable, NETPROBE, *arguments]),
                                            capture_output=True, text=True, check=True).stdout)

            def report(name, rate_bit):
                emulated.shape(rate_bit)
                nbytes = str(int(min(400 << 20, (rate_bit or 8e9) / 8 * 1.5)))
                latency = probe(1, "latency", emulated.addresses[0], "5555")
                single = probe(1, "stream", emulated.addresses[0], "5555", nbytes)
                ring = [subprocess.Popen(emulated.exec_in(i, [sys.executable, NETPROBE, "stream",
                                                              emulated.addresses[(i + 1) % args.hosts], "5555",
                                                              nbytes]), stdout=subprocess.PIPE, text=True)
                        for i in range(args.hosts)]
                rates = [float(process.communicate()[0]) for process in ring]
                print(f"{name:<34} one-way latency {latency:6.1f} us (TCP ping-pong / 2), one stream "
                      f"{single:6.2f} Gb/s, {args.hosts} streams at once {min(rates):.2f}-{max(rates):.2f} Gb/s each")
            report("unshaped veth", None)
            for link in args.links.split(","):
                profile = cluster_hosts.PROFILES[link]
                report(f"{link} / scale {args.scale:g} ({profile.shaped_rate_bit(args.scale) / 1e6:.0f} Mb/s)",
                       profile.shaped_rate_bit(args.scale))
        finally:
            for server in servers:
                server.kill()


def command_profile(args):
    import real_models
    for model in args.models.split(","):
        profile = real_models.profile(model, args.batch, progress=log if args.verbose else None)
        path = os.path.join(HERE, "profiles", f"{model}.cpu.json")
        with open(path, "w") as output:
            json.dump(profile, output, indent=1)
        stages = profile_model.stages(profile)
        print(f"{model}: {profile['parameters']:,} weights, {len(stages)} stages, forward "
              f"{sum(s[2] for s in stages) * 1e3:.0f} ms, backward {sum(s[3] for s in stages) * 1e3:.0f} ms "
              f"at batch {args.batch}; written to {path}")


def command_project(args):
    import projection
    result = projection.main(args)
    name = args.profile and os.path.splitext(os.path.basename(args.profile))[0].split(".")[0]
    published = [entry for entry in PUBLISHED if entry[0] == name]
    if published:
        print("\nBeside published figures (efficiency = speed-up / ranks):")
        for _, ranks, efficiency, what in published:
            projected = result.get(ranks)
            mine = "" if projected is None else f"; projected here {projected['tarantella'][1]:.2f}"
            print(f"  {ranks} ranks: {efficiency:.2f}: {what}{mine}")


def compare(first_path, second_path):
    runs = []
    for path in (first_path, second_path):
        with open(path) as saved:
            runs.append(json.load(saved)["results"])
    agree = True
    print(f"{'model':<16}{'p':>4} {'link':<6}{'variant':<14}{'first':>8}{'second':>8}  difference (efficiency)")
    for model, by_p in runs[0].items():
        for p, result in by_p.items():
            other = runs[1].get(model, {}).get(p)
            if other is None:
                continue
            for link, by_label in result["analysis"].items():
                for label, row in by_label.items():
                    if "efficiency" not in row or label not in other["analysis"].get(link, {}):
                        continue
                    first, second = row["efficiency"]["median"], other["analysis"][link][label]["efficiency"]["median"]
                    difference = abs(second / first - 1)
                    agree &= difference <= AGREEMENT
                    print(f"{model:<16}{p:>4} {link:<6}{label:<14}{first:>8.3f}{second:>8.3f}  {difference * 100:5.1f}%"
                          + ("" if difference <= AGREEMENT else f"  more than {AGREEMENT:.0%} apart"))
    print(f"The runs {'agree' if agree else 'do NOT agree'} within {AGREEMENT:.0%} on every efficiency.")
    return agree


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs=2, metavar="FILE.json",
                        help="measure nothing: check that two `run --json` files agree within 5%% on every efficiency")
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("run", help="measure the variants over the emulated cluster (root)")
    run.add_argument("--models", default="resnet50,transformer_big",
                     help=f"from {', '.join(MODELS)}, or profile JSON files of your own")
    run.add_argument("--ranks", default="2,4,8,16", help="comma-separated rank counts (default 2,4,8,16)")
    run.add_argument("--backend", default="tensorflow", choices=("tensorflow", "jax", "torch"),
                     help="the ranks' Keras backend (default tensorflow)")
    run.add_argument("--ranks-per-host", type=int, default=1, help="ranks per emulated host (default 1)")
    run.add_argument("--links", default="ib,10gbe", help=f"link profiles, from {', '.join(cluster_hosts.PROFILES)}")
    run.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                     help=f"byte scale: gradient sizes, thresholds and link rates divided by it (default {DEFAULT_SCALE})")
    run.add_argument("--thresholds", help="the two extra fusion thresholds, nominal KiB (default "
                     + ",".join(f"{kb:g}" for kb in DEFAULT_THRESHOLDS) + ")")
    run.add_argument("--variants", help="time only these labels (compute is always timed); without it, every "
                     "tarantella variant, and horovod where --horovod-venv has Horovod; keras2 only where named")
    run.add_argument("--horovod-venv", metavar="DIR", default=DEFAULT_HOROVOD_VENV,
                     help="the environment benchmarks/make_horovod_venv.sh built, whose Python runs the horovod "
                          "and keras2 variants (default: .venv-horovod in the repository)")
    run.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    run.add_argument("--steps", type=int, default=2, help="timed steps per window (default 2)")
    run.add_argument("--json", metavar="FILE.json", help="write every window and the analysis")
    run.add_argument("--plot", metavar="FILE.png", help="draw efficiency against ranks (needs matplotlib)")
    run.add_argument("--timeline", metavar="FILE.json",
                     help="record tarantella's timeline in the largest p's job (its step report goes to that job's log)")
    links = commands.add_parser("links", help="measure the emulated links (root)")
    links.add_argument("--hosts", type=int, default=4)
    links.add_argument("--links", default="ib,10gbe")
    links.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    profile = commands.add_parser("profile", help="time the real models layer by layer on this CPU")
    profile.add_argument("--models", default=",".join(MODELS))
    profile.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    profile.add_argument("--verbose", action="store_true", help="print every layer's times")
    report = commands.add_parser("report", help="print the tables (and --plot) of a saved `run --json` file")
    report.add_argument("files", nargs="+", metavar="FILE.json", help="one run, or several (their models, rank "
                        "counts, links and variants merged; a later file's configuration replaces an earlier one's)")
    report.add_argument("--plot", metavar="FILE.png")
    project = commands.add_parser("project", help="model the step at large p from a profile or a trace")
    import projection
    projection.add_arguments(project)
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    if args.command == "report":
        run = None
        for path in args.files:  # several runs' configurations merged, in order
            with open(path) as saved:
                loaded = json.load(saved)
            if run is None:
                run = loaded
                continue
            for model, by_p in loaded["results"].items():
                run["results"].setdefault(model, {}).update(by_p)
            # Runs of other variants or links: every one shown, each cell where it was timed.
            run["labels"] += [label for label in loaded["labels"] if label not in run["labels"]]
            run["links"] += [link for link in loaded["links"] if link not in run["links"]]
        print_table(run["results"], run["links"], run["labels"])
        print("\nEfficiency per variant (compute-only step / step, median and IQR over rounds):\n")
        print_summary(run["results"], run["links"], run["labels"])
        print_model_error(run["results"])
        print_probes(run["results"])
        print_horovod(run["results"])
        lines = judge(run["results"])
        if lines:
            print("\nTargets:\n" + "\n".join(lines))
        if args.plot:
            plot(run["results"], run["links"], run["labels"], args.plot)
        return
    if args.command is None:
        parser.error("name a command: run, links, profile or project (see --help)")
    {"run": command_run, "links": command_links, "profile": command_profile, "project": command_project}[args.command](args)


if __name__ == "__main__":
    main()
