"""A model of one data-parallel training step: the profile's compute, the bucket-ready schedule
tarantella's fusion plan gives, and the cost of each bucket's allreduce on a link of latency
`alpha` (seconds per message) and bandwidth `beta` (bytes per second per direction).

The communicator's worker reduces buckets one at a time in plan order, each as soon as it is
ready and the one before is done; the step ends when backprop and the last reduction are both
done, plus what the step costs besides (`tail`: the optimizer's update, the opening and metrics
collectives, Keras' loop: measured as the compute-only step minus the profile's compute).

Allreduce costs (p ranks, s bytes; Thakur, Rabenseifner and Gropp's classic estimates, no
reduction time):
  ring                 2 (p-1) (alpha + s / (p beta))           tarantella's ring, buckets >= 1 MiB
  recursive doubling   ceil(log2 p) (alpha + s / beta)           MPI_Allreduce on small messages
  Rabenseifner         2 ceil(log2 p) alpha + 2 (p-1)/p s / beta  MPI_Allreduce on large ones
  tree                 the cheaper of the two MPI algorithms (latency O(log p)): what a tree or
                       MPI's own allreduce could do for every bucket
"""

import importlib.util
import math
import pathlib

RING_MIN_BYTES = 1 << 20  # tarantella.runtime.reducer._RING_MIN_BYTES


def _fusion():
    """tarantella/backends/fusion.py (NumPy only), loaded from its file: importing it by its name would
    first import the tarantella package, which starts TensorFlow and MPI in the benchmark's driver."""
    path = pathlib.Path(__file__).resolve().parents[2] / "tarantella" / "backends" / "fusion.py"
    spec = importlib.util.spec_from_file_location("tarantella_fusion_for_the_step_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FUSION = _fusion()


def plan_buckets(sizes_in_bytes, threshold_bytes):
    """tarantella's fusion plan for tensors of one dtype."""
    return _FUSION.plan_buckets(sizes_in_bytes, ["float32"] * len(sizes_in_bytes), threshold_bytes)


def schedule(stages, threshold_bytes, scale=1.0, bytes_per_element=4):
    """(compute_s, [(ready_s, nbytes)] in plan order) from stages [(name, sizes, forward_s, backward_s)]
    in forward order: each weight's gradient is ready when its stage's backward pass ends; gradients
    are listed in backprop order (last stage first, a stage's last weight first) as tarantella lists
    them, sizes divided by `scale` (at least one element), then cut into buckets."""
    forward = sum(stage[2] for stage in stages)
    clock, tensors = forward, []
    for _, sizes, _, backward_s in reversed(stages):
        clock += backward_s
        for size in reversed(sizes):
            tensors.append((clock, max(1, round(size / scale)) * bytes_per_element))
    plan = plan_buckets([nbytes for _, nbytes in tensors], threshold_bytes)
    buckets = [(max(tensors[i][0] for i in members), sum(tensors[i][1] for i in members)) for members in plan]
    return clock, buckets


def log2_steps(p):
    return math.ceil(math.log2(p)) if p > 1 else 0


def ring_cost(nbytes, p, alpha, beta):
    return 0.0 if p < 2 else 2 * (p - 1) * (alpha + nbytes / (p * beta))


def mpi_cost(nbytes, p, alpha, beta):
    if p < 2:
        return 0.0
    doubling = log2_steps(p) * (alpha + nbytes / beta)
    rabenseifner = 2 * log2_steps(p) * alpha + 2 * (p - 1) / p * nbytes / beta
    return min(doubling, rabenseifner)


def bucket_cost(nbytes, p, alpha, beta, algorithm="tarantella", ring_min_bytes=RING_MIN_BYTES, ring_alpha=None):
    """One bucket's allreduce: "tarantella" (ring from ring_min_bytes, MPI below), "ring", "mpi"/"tree"."""
    if algorithm == "ring" or (algorithm == "tarantella" and nbytes >= ring_min_bytes):
        return ring_cost(nbytes, p, alpha if ring_alpha is None else ring_alpha, beta)
    return mpi_cost(nbytes, p, alpha, beta)


def finish_time(buckets, p, alpha, beta, per_bucket_s=0.0, **cost_options):
    """When the serial worker has reduced the last bucket, from the step's start."""
    clock = 0.0
    for ready, nbytes in buckets:
        clock = max(clock, ready) + per_bucket_s + bucket_cost(nbytes, p, alpha, beta, **cost_options)
    return clock


def predicted_step(compute_s, buckets, p, alpha, beta, tail_s=0.0, per_bucket_s=0.0, **cost_options):
    """The modelled step: backprop and the reductions both done, plus the rest of the step."""
    return max(compute_s, finish_time(buckets, p, alpha, beta, per_bucket_s, **cost_options)) + tail_s


def limit_step(compute_s, buckets, p, alpha, beta, tail_s=0.0, **cost_options):
    """The configuration's own limit: the last bucket's ready time plus what its reduction must still
    cost (no earlier bucket delaying it), or the compute alone where that is later."""
    if not buckets:
        return compute_s + tail_s
    ready, nbytes = buckets[-1]
    return max(compute_s, ready + bucket_cost(nbytes, p, alpha, beta, **cost_options)) + tail_s


def efficiency(compute_s, step_s):
    return compute_s / step_s
