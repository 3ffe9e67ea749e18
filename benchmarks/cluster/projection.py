"""`emulated_cluster.py project`: the step model (step_model.py) at many ranks, for a profile of
benchmarks/profiles/, a profile JSON of your own (`emulated_cluster.py profile` writes one), or a
`tarantella --timeline` trace.

From a trace: with 2 or more ranks, the trace holds each bucket's hand-over (its ready time in
the step) and its bytes: the schedule is the master's, median over the steps after the first.
A 1-rank trace holds only the steps (a 1-rank tnt.Model is plain Keras); then --model-file (a
saved Keras model) gives the weights, backprop is taken as 2/3 of the step, spread over the
layers in proportion to their weights, with the gradients listed as tarantella lists them.
"""

import json
import math
import os
import statistics

import hosts as cluster_hosts
import profile_model
import step_model


def add_arguments(parser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a profile name (resnet50, ...) or JSON file")
    source.add_argument("--trace", help="a tarantella --timeline trace (Chrome JSON)")
    parser.add_argument("--model-file", help="with a 1-rank --trace: the saved Keras model (.keras), for its weights")
    parser.add_argument("--ranks", default="2,4,8,16,96,256,1024", help="rank counts (default 2,...,1024)")
    parser.add_argument("--link", default="ib", help="a link profile: ib (100 Gb/s, 1.5 us) or 10gbe (10 Gb/s, 25 us)")
    parser.add_argument("--latency-us", type=float, help="your network's one-way latency per message (overrides --link)")
    parser.add_argument("--gbit", type=float, help="your network's rate per direction, Gb/s (overrides --link)")
    parser.add_argument("--threshold-kb", type=float, default=32, help="fusion threshold, KiB (default 32)")
    parser.add_argument("--step-seconds", type=float,
                        help="scale the profile's compute to this step time (e.g. your accelerator's 1-rank step)")
    parser.add_argument("--per-bucket-us", type=float, default=0.0,
                        help="fixed cost per bucket on the worker (default 0)")
    parser.add_argument("--json", metavar="FILE.json", help="write the projection")


def schedule_from_trace(path):
    """(compute_s, buckets) from a trace with bucket hand-overs (2+ ranks); None for a 1-rank trace,
    with the median step time."""
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
        return None, median_step_s
    per_bucket = {}
    for step in steps:
        for e in handovers:
            if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]:
                per_bucket.setdefault(int(e["name"].rsplit(" ", 1)[1]), []).append((e["ts"] - step["ts"]) / 1e6)
    buckets = [(statistics.median(per_bucket[i]), sizes[i]) for i in sorted(per_bucket) if i in sizes]
    return max(ready for ready, _ in buckets), buckets


def stages_from_model_file(path, step_s):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    model = keras.saving.load_model(path, compile=False)
    layers = [[layer.name, [math.prod(w.shape) for w in layer.trainable_weights]] for layer in model.layers
              if layer.trainable_weights]
    total = sum(sum(sizes) for _, sizes in layers) or 1
    backward = step_s * 2 / 3
    return [(name, sizes, step_s / 3 / len(layers), backward * sum(sizes) / total) for name, sizes in layers]


def link_of(args):
    profile = cluster_hosts.PROFILES[args.link]
    latency_us = args.latency_us if args.latency_us is not None else profile.latency_us
    gbit = args.gbit if args.gbit is not None else profile.gbit
    return latency_us * 1e-6, gbit * 1e9 / 8, f"{gbit:g} Gb/s, {latency_us:g} us"


def project(compute_s, buckets, ranks, alpha, beta, per_bucket_s=0.0):
    """{p: {strategy: (step_s, efficiency)}}: tarantella (ring from 1 MiB, MPI below), every bucket
    by MPI's tree-like algorithms, and one bucket after backprop (no overlap)."""
    total = sum(nbytes for _, nbytes in buckets)
    out = {}
    for p in ranks:
        row = {}
        for name, plan, algorithm in (("tarantella", buckets, "tarantella"), ("tree", buckets, "mpi"),
                                      ("one bucket", [(compute_s, total)], "tarantella")):
            step = step_model.predicted_step(compute_s, plan, p, alpha, beta, 0.0, per_bucket_s, algorithm=algorithm)
            row[name] = (step, compute_s / step)
        out[p] = row
    return out


def main(args):
    ranks = [int(p) for p in args.ranks.split(",")]
    alpha, beta, described = link_of(args)
    if args.profile:
        profile = profile_model.load(args.profile)
        stages = profile_model.stages(profile)
        name, device = profile["model"], profile["device"] + f", batch {profile['batch']}"
    else:
        compute_s, buckets = schedule_from_trace(args.trace)
        name, device = os.path.basename(args.trace), "the trace's"
        if buckets is None:
            if not args.model_file:
                raise SystemExit("a 1-rank trace holds no bucket schedule: add --model-file MODEL.keras")
            stages = stages_from_model_file(args.model_file, buckets_step := compute_s)
        else:
            stages = None
    if stages is not None:
        total = sum(s[2] + s[3] for s in stages)
        if args.step_seconds:
            factor = args.step_seconds / total
            stages = [(n, sizes, f * factor, b * factor) for n, sizes, f, b in stages]
        compute_s, buckets = step_model.schedule(stages, int(args.threshold_kb * 1024))
    elif args.step_seconds:
        factor = args.step_seconds / compute_s
        compute_s, buckets = compute_s * factor, [(r * factor, n) for r, n in buckets]
    result = project(compute_s, buckets, ranks, alpha, beta, args.per_bucket_us * 1e-6)
    total = sum(n for _, n in buckets)
    print(f"{name}: compute {compute_s * 1e3:.0f} ms per step ({device}), {len(buckets)} buckets, "
          f"{total / 1e6:.1f} MB of gradients; link {described}")
    print(f"{'ranks':>6}  {'tarantella step ms':>18} {'efficiency':>10}  {'tree, every bucket':>18} {'efficiency':>10}  "
          f"{'one bucket':>10} {'efficiency':>10}")
    for p, row in result.items():
        print(f"{p:>6}  {row['tarantella'][0] * 1e3:>18.1f} {row['tarantella'][1]:>10.3f}  "
              f"{row['tree'][0] * 1e3:>18.1f} {row['tree'][1]:>10.3f}  {row['one bucket'][0] * 1e3:>10.1f} "
              f"{row['one bucket'][1]:>10.3f}")
    if args.json:
        with open(args.json, "w") as output:
            json.dump({"model": name, "compute_s": compute_s, "buckets": buckets, "link": described,
                       "projection": {str(p): row for p, row in result.items()}}, output, indent=1)
    return result
