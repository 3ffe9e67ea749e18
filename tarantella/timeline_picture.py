"""`tarantella-timeline TRACE.json PICTURE.png`: draws a trace that `tarantella --timeline` wrote
(`tarantella-timeline TRACE.json --project ...` models its step at many ranks instead:
timeline_projection.py).

One group of three lanes per rank (main thread, the step's collective calls, the collectives
worker) over a few consecutive training steps of the master, on the master's clock, so that
documentation and issue reports can show where a step's time goes. Needs matplotlib
(pip install 'tarantella[plot]'); imports neither TensorFlow nor MPI.
"""

import argparse
import json
import sys

from tarantella import timeline_projection
from tarantella.timeline_report import MAIN_ROW, OPS_ROW, WORKER_ROW

# Category -> (colour, legend). Slices drawn over a longer one (waiting, transfer) are drawn thinner.
_COLOURS = {
    "step": ("#d9d9d9", "training or test step"), "input": ("#f4a259", "waiting for input"),
    "callbacks": ("#b07aa1", "callbacks and Keras' loop"), "save": ("#8c564b", "save"),
    "opening": ("#4e79a7", "step opening (sizes, agreement)"), "gradients": ("#59a14f", "gradient buckets"),
    "metrics": ("#76b7b2", "losses and metrics"), "batchnorm": ("#edc948", "synchronized BatchNorm"),
    "public": ("#9c755f", "public collectives"), "other": ("#bab0ac", "other collectives"),
    "waiting": ("#e15759", "waiting for the latest rank"), "transfer": ("#2f4b7c", "transfer"),
}
_THIN = {"waiting", "transfer", "input", "callbacks", "save"}
_LANES = [(MAIN_ROW, "main"), (OPS_ROW, "step ops"), (WORKER_ROW, "worker")]


def window(events, first_step, steps):
    """(start, end) in us of the master's training steps first_step .. first_step + steps - 1."""
    masters = sorted((e for e in events if e["pid"] == 0 and e["name"].startswith("training step")),
                     key=lambda e: e["ts"])
    if not masters:
        raise SystemExit("tarantella-timeline: the trace holds no training steps.")
    chosen = masters[min(first_step, len(masters)) - 1:][:steps]
    return chosen[0]["ts"], chosen[-1]["ts"] + chosen[-1]["dur"]


def draw(trace, path, first_step=2, steps=2):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("tarantella-timeline needs matplotlib: pip install 'tarantella[plot]'.") from None
    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    start, end = window(events, first_step, steps)
    margin = (end - start) * 0.02
    start, end = start - margin, end + margin
    ranks = sorted({e["pid"] for e in events})
    lane_of = {(rank, row): len(_LANES) * (len(ranks) - 1 - position) + len(_LANES) - 1 - lane
               for position, rank in enumerate(ranks) for lane, (row, _) in enumerate(_LANES)}
    figure, axis = plt.subplots(figsize=(12, 0.45 * len(lane_of) + 1.4))
    used = set()
    for event in sorted(events, key=lambda e: (e["cat"] in _THIN, e["ts"])):
        if event["ts"] > end or event["ts"] + event["dur"] < start:
            continue
        category = event["cat"] if event["cat"] in _COLOURS else "other"
        used.add(category)
        height = 0.45 if category in _THIN else 0.8
        y = lane_of[(event["pid"], event["tid"])]
        left = max(event["ts"], start)
        axis.broken_barh([((left - start) / 1e3, (min(event["ts"] + event["dur"], end) - left) / 1e3)],
                         (y - height / 2, height), facecolors=_COLOURS[category][0], edgecolor="none")
    axis.set_yticks(list(lane_of.values()), [f"rank {rank} {name}" for rank in ranks for _, name in _LANES])
    for position in range(1, len(ranks)):
        axis.axhline(len(_LANES) * position - 0.5, color="black", linewidth=0.6)
    axis.set_xlim(0, (end - start) / 1e3)
    axis.set_ylim(-0.6, len(lane_of) - 0.4)
    axis.set_xlabel("ms (the master's clock)")
    axis.set_title(f"{trace.get('otherData', {}).get('ranks', len(ranks))} ranks, training steps {first_step} to "
                   f"{first_step + steps - 1} of the master")
    legend = [matplotlib.patches.Patch(color=_COLOURS[c][0], label=_COLOURS[c][1]) for c in _COLOURS if c in used]
    axis.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def build_parser():
    """The `tarantella-timeline` command's argument parser (the documentation's command reference is made
    from it)."""
    parser = argparse.ArgumentParser(prog="tarantella-timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="the file `tarantella --timeline FILE` wrote")
    parser.add_argument("picture", nargs="?", help="the PNG file to write")
    parser.add_argument("--first-step", type=int, default=2,
                        help="the master's first training step to show, counted from 1 (default 2: step 1 traces)")
    parser.add_argument("--steps", type=int, default=2, help="consecutive steps to show (default 2)")
    projection = parser.add_argument_group(
        "projection", "--project models the traced step at many ranks on your network instead of drawing it")
    projection.add_argument("--project", action="store_true",
                            help="print the modelled step and efficiency at --ranks on your network")
    timeline_projection.add_arguments(projection)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.project:
        return timeline_projection.main(args, parser)
    if args.picture is None:
        parser.error("name the PNG file to write (or --project, to model the step at many ranks)")
    if args.first_step < 1 or args.steps < 1:
        parser.error("--first-step and --steps must be at least 1")
    with open(args.trace) as file:
        trace = json.load(file)
    draw(trace, args.picture, args.first_step, args.steps)
    print(f"tarantella-timeline: wrote {args.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
