"""`tarantella-timeline TRACE.json --project`: a model of one training step at many ranks, from a trace
that `tarantella --timeline` wrote and a network's latency and bandwidth.

The model: each gradient bucket becomes ready in backprop at the time the trace shows (from a trace
of 2 or more ranks: each bucket's hand-over and bytes, median over the master's steps after the
first), or, from a 1-rank trace and the saved model, at a time spread over backprop in proportion
to the layers' weights (backprop taken as 2/3 of the step), cut into buckets by tarantella's own
fusion plan with the threshold the job would get. The worker reduces buckets one at a time in plan
order, each as soon as it is ready and the one before is done; the step ends when backprop and the
last reduction are both done.

Allreduce costs for p ranks, s bytes, latency alpha (seconds per message) and bandwidth beta (bytes
per second per direction); the classic estimates of Thakur, Rabenseifner and Gropp, no reduction
time:
  ring                 2 (p-1) (alpha + s / (p beta))           tarantella's ring, buckets >= 1 MiB
  recursive doubling   ceil(log2 p) (alpha + s / beta)           MPI_Allreduce on small messages
  Rabenseifner         2 ceil(log2 p) alpha + 2 (p-1)/p s / beta  MPI_Allreduce on large ones
  tree                 the cheaper of the two MPI algorithms, for every bucket

It is an upper bound on the efficiency: no cost per bucket besides the messages (unless
--per-bucket-us), no contention, every rank as fast as the traced one.

This module imports only the standard library at its top (benchmarks/ loads it from its file, in a
process that must not become a rank); the fusion plan is imported where a saved model needs it.
"""

import json
import math
import statistics

RING_MIN_BYTES = 1 << 20  # runtime.reducer._RING_MIN_BYTES, which a test holds equal to this


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
    """When the serial worker has reduced the last of `buckets` [(ready_s, nbytes)], from the step's start."""
    clock = 0.0
    for ready, nbytes in buckets:
        clock = max(clock, ready) + per_bucket_s + bucket_cost(nbytes, p, alpha, beta, **cost_options)
    return clock


def predicted_step(compute_s, buckets, p, alpha, beta, tail_s=0.0, per_bucket_s=0.0, **cost_options):
    """The modelled step: backprop and the reductions both done, plus the rest of the step (`tail_s`)."""
    return max(compute_s, finish_time(buckets, p, alpha, beta, per_bucket_s, **cost_options)) + tail_s


def limit_step(compute_s, buckets, p, alpha, beta, tail_s=0.0, **cost_options):
    """A configuration's own limit: the last bucket's ready time plus what its reduction must still cost
    (no earlier bucket delaying it), or the compute alone where that is later."""
    if not buckets:
        return compute_s + tail_s
    ready, nbytes = buckets[-1]
    return max(compute_s, ready + bucket_cost(nbytes, p, alpha, beta, **cost_options)) + tail_s


def schedule(stages, threshold_bytes, plan_buckets, scale=1.0, bytes_per_element=4):
    """(compute_s, [(ready_s, nbytes)] in plan order) from stages [(name, sizes, forward_s, backward_s)]
    in forward order: each weight's gradient is ready when its stage's backward pass ends; gradients
    are listed in backprop order (last stage first, a stage's last weight first) as tarantella lists
    them, sizes divided by `scale` (at least one element), then cut into buckets by `plan_buckets`
    (backends/fusion.py's)."""
    clock, tensors = sum(stage[2] for stage in stages), []
    for _, sizes, _, backward_s in reversed(stages):
        clock += backward_s
        for size in reversed(sizes):
            tensors.append((clock, max(1, round(size / scale)) * bytes_per_element))
    plan = plan_buckets([nbytes for _, nbytes in tensors], ["float32"] * len(tensors), threshold_bytes)
    buckets = [(max(tensors[i][0] for i in members), sum(tensors[i][1] for i in members)) for members in plan]
    return clock, buckets


def schedule_from_trace(path):
    """(compute_s, buckets) from a trace with bucket hand-overs (2+ ranks); (median step s, None) for a
    1-rank trace."""
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    steps = sorted((e for e in events if e.get("pid") == 0 and e.get("cat") == "step"
                    and e["name"].startswith("train") and "traces" not in e["name"]), key=lambda e: e["ts"])
    if not steps:
        raise SystemExit(f"{path}: no training steps of rank 0 in this trace")
    median_step_s = statistics.median(e["dur"] for e in steps) / 1e6
    handovers = [e for e in events if e.get("pid") == 0 and e["name"].startswith("hand-over of bucket")]
    sizes = {}
    for e in events:
        if e.get("pid") == 0 and e.get("cat") == "gradients" and e.get("ph") == "X" and "bytes" in e.get("args", {}):
            sizes[e["args"]["bucket"]] = e["args"]["bytes"]
    if not handovers or not sizes:
        return median_step_s, None
    per_bucket = {}
    for step in steps:
        for e in handovers:
            if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]:
                per_bucket.setdefault(int(e["name"].rsplit(" ", 1)[1]), []).append((e["ts"] - step["ts"]) / 1e6)
    buckets = [(statistics.median(per_bucket[i]), sizes[i]) for i in sorted(per_bucket) if i in sizes]
    return max(ready for ready, _ in buckets), buckets


def stages_from_model_file(path, step_s):
    """Stages [(name, sizes, forward_s, backward_s)] of a saved Keras model whose step takes `step_s`:
    forward a third of it, evenly per layer, backprop two thirds, in proportion to each layer's weights."""
    import keras
    model = keras.saving.load_model(path, compile=False)
    layers = [[layer.name, [math.prod(w.shape) for w in layer.trainable_weights]] for layer in model.layers
              if layer.trainable_weights]
    total = sum(sum(sizes) for _, sizes in layers) or 1
    backward = step_s * 2 / 3
    return [(name, sizes, step_s / 3 / len(layers), backward * sum(sizes) / total) for name, sizes in layers]


def project(compute_s, buckets_at, ranks, alpha, beta, per_bucket_s=0.0):
    """{p: {strategy: (step_s, efficiency)}}: tarantella (ring from 1 MiB, MPI below), every bucket by
    MPI's tree-like algorithms, and one bucket after backprop (no overlap). `buckets_at(p)` gives the
    bucket schedule at p ranks (the automatic fusion threshold grows with p and the link)."""
    out = {}
    for p in ranks:
        buckets = buckets_at(p)
        total = sum(nbytes for _, nbytes in buckets)
        row = {}
        for name, plan, algorithm in (("tarantella", buckets, "tarantella"), ("tree", buckets, "mpi"),
                                      ("one bucket", [(compute_s, total)], "tarantella")):
            step = predicted_step(compute_s, plan, p, alpha, beta, 0.0, per_bucket_s, algorithm=algorithm)
            row[name] = (step, compute_s / step)
        out[p] = row
    return out


def add_arguments(parser):
    """The projection's options (the `tarantella-timeline` command's, and benchmarks/' `project`)."""
    parser.add_argument("--ranks", default="2,4,8,16,96,256,1024", help="rank counts to project to "
                        "(default 2,4,8,16,96,256,1024)")
    parser.add_argument("--latency-us", type=float, help="the network's one-way latency per message, microseconds")
    parser.add_argument("--gbit", type=float, help="the network's rate per direction, Gb/s")
    parser.add_argument("--model-file", help="with a 1-rank trace: the saved Keras model (.keras), for its weights")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="ranks per node, for the automatic fusion threshold of a 1-rank trace (default 1)")
    parser.add_argument("--threshold-kb", type=float,
                        help="the fusion threshold for a 1-rank trace, KiB (default: the automatic one at each "
                             "rank count)")
    parser.add_argument("--step-seconds", type=float,
                        help="scale the compute to this step time (e.g. another device's 1-rank step)")
    parser.add_argument("--per-bucket-us", type=float, default=0.0,
                        help="a fixed cost per bucket on the worker, microseconds (default 0)")
    parser.add_argument("--json", metavar="FILE.json", help="also write the projection to this file")


def scaled_stages(stages, step_seconds):
    """`stages` with their compute scaled to a step of `step_seconds` (unchanged where None)."""
    if not step_seconds:
        return stages
    factor = step_seconds / sum(s[2] + s[3] for s in stages)
    return [(n, sizes, f * factor, b * factor) for n, sizes, f, b in stages]


def print_projection(name, compute_s, buckets_at, ranks, alpha, beta, described, per_bucket_s=0.0, json_path=None):
    """Projects and prints a table of the step and efficiency per rank count; returns the projection."""
    result = project(compute_s, buckets_at, ranks, alpha, beta, per_bucket_s)
    total = sum(n for _, n in buckets_at(ranks[0]))
    print(f"{name}: compute {compute_s * 1e3:.0f} ms per step, {total / 1e6:.1f} MB of gradients; {described}")
    print(f"{'ranks':>6} {'buckets':>7}  {'tarantella step ms':>18} {'efficiency':>10}  {'tree, every bucket':>18} "
          f"{'efficiency':>10}  {'one bucket':>10} {'efficiency':>10}")
    for p, row in result.items():
        print(f"{p:>6} {len(buckets_at(p)):>7}  {row['tarantella'][0] * 1e3:>18.1f} {row['tarantella'][1]:>10.3f}  "
              f"{row['tree'][0] * 1e3:>18.1f} {row['tree'][1]:>10.3f}  {row['one bucket'][0] * 1e3:>10.1f} "
              f"{row['one bucket'][1]:>10.3f}")
    if json_path:
        with open(json_path, "w") as output:
            json.dump({"model": name, "compute_s": compute_s, "link": described,
                       "buckets": {str(p): buckets_at(p) for p in ranks},
                       "projection": {str(p): row for p, row in result.items()}}, output, indent=1)
    return result


def schedules(args, compute_s, buckets, stages, fusion):
    """(compute_s, buckets_at, what the plan is) for `project`: a trace's own `buckets` at every rank
    count, or `stages` cut by `fusion` (backends/fusion.py) with --threshold-kb or the automatic
    threshold at each rank count; either scaled to --step-seconds."""
    if stages is not None:
        stages = scaled_stages(stages, args.step_seconds)

        def buckets_at(p):
            threshold = (args.threshold_kb * 1024 if args.threshold_kb is not None else
                         fusion.automatic_threshold_bytes(p, math.ceil(p / args.ranks_per_node),
                                                          args.latency_us * 1e-6, args.gbit * 1e9 / 8))
            return schedule(stages, int(threshold), fusion.plan_buckets)[1]
        return (sum(s[2] + s[3] for s in stages), buckets_at,
                "fusion threshold " + (f"{args.threshold_kb:g} KiB" if args.threshold_kb is not None else
                                       "tarantella's automatic one at each rank count on this link"))
    if args.step_seconds:
        factor = args.step_seconds / compute_s
        compute_s, buckets = compute_s * factor, [(r * factor, n) for r, n in buckets]
    return compute_s, lambda p: buckets, f"the trace's {len(buckets)} buckets at every rank count"


def main(args, parser):
    """`tarantella-timeline TRACE --project ...` (args from `add_arguments`)."""
    if args.latency_us is None or args.gbit is None:
        parser.error("--project needs your network's --latency-us and --gbit (e.g. InfiniBand HDR: "
                     "--latency-us 1.5 --gbit 200; 10 Gigabit Ethernet: --latency-us 25 --gbit 10)")
    try:
        ranks = [int(p) for p in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: give rank counts separated by commas, e.g. 16,96,256")
    compute_s, buckets = schedule_from_trace(args.trace)
    stages = None
    if buckets is None:
        if not args.model_file:
            parser.error(f"{args.trace} is a 1-rank trace, which holds no gradient buckets: add --model-file "
                         "MODEL.keras (the model the traced script trains, saved with model.save)")
        stages = stages_from_model_file(args.model_file, compute_s)
    from tarantella.backends import fusion
    compute_s, buckets_at, plan = schedules(args, compute_s, buckets, stages, fusion)
    print_projection(args.trace, compute_s, buckets_at, ranks, args.latency_us * 1e-6, args.gbit * 1e9 / 8,
                     f"{plan}; link {args.gbit:g} Gb/s, {args.latency_us:g} us", args.per_bucket_us * 1e-6, args.json)
    return 0
