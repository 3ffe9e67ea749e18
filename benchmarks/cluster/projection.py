"""`emulated_cluster.py project`: the step model at many ranks for a profile of benchmarks/profiles/ or
a profile JSON of your own (`emulated_cluster.py profile` writes one), or for a `tarantella --timeline`
trace as `tarantella-timeline TRACE --project` models it (the model and the trace reading are
tarantella's own, tarantella/timeline_projection.py), with the link profiles of the emulation.
"""

import hosts as cluster_hosts
import profile_model
import step_model

MODEL = step_model.projection


def add_arguments(parser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a profile name (resnet50, ...) or JSON file")
    source.add_argument("--trace", help="a tarantella --timeline trace (Chrome JSON)")
    parser.add_argument("--link", default="ib", help="a link profile: ib (100 Gb/s, 1.5 us) or 10gbe (10 Gb/s, 25 us)")
    MODEL.add_arguments(parser)


def link_of(args):
    profile = cluster_hosts.PROFILES[args.link]
    latency_us = args.latency_us if args.latency_us is not None else profile.latency_us
    gbit = args.gbit if args.gbit is not None else profile.gbit
    return latency_us * 1e-6, gbit * 1e9 / 8, f"{gbit:g} Gb/s, {latency_us:g} us"


def main(args):
    ranks = [int(p) for p in args.ranks.split(",")]
    alpha, beta, link = link_of(args)
    if args.profile:
        profile = profile_model.load(args.profile)
        compute_s, buckets, stages = None, None, profile_model.stages(profile)
        name = f"{profile['model']} ({profile['device']}, batch {profile['batch']})"
    else:
        compute_s, buckets = MODEL.schedule_from_trace(args.trace)
        name, stages = args.trace, None
        if buckets is None:
            if not args.model_file:
                raise SystemExit("a 1-rank trace holds no bucket schedule: add --model-file MODEL.keras")
            stages = MODEL.stages_from_model_file(args.model_file, compute_s)
    compute_s, buckets_at, plan = MODEL.schedules(args, compute_s, buckets, stages, step_model.FUSION)
    return MODEL.print_projection(name, compute_s, buckets_at, ranks, alpha, beta, f"{plan}; link {link}",
                                  args.per_bucket_us * 1e-6, args.json)
