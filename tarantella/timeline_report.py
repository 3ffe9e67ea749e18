"""The timeline's analysis: the ranks' recorded events as one Chrome trace, and the step report printed after `fit`.

Every rank's events are moved onto the master's clock (`timeline.py` measured the offsets), the
n-th collective of every rank is matched with the n-th of the others, and each step's time is
split into compute, input wait, communication that backprop did not hide, and waiting for the
slowest rank, with advice where one of them is large.
"""

import bisect
import statistics

from tarantella.runtime.kinds import Collective

MAIN_ROW, OPS_ROW, WORKER_ROW = 1, 2, 3  # the rows of each rank in the trace
# A straggler is named when this share of the other ranks' waiting was for it (in the steps it
# was the slowest in), and they wait at least _STRAGGLER_WAIT of their step.
_STRAGGLER_BLAME = 0.75
_STRAGGLER_WAIT = 0.05
_NOTABLE = 0.10  # input wait or unhidden communication above this share of the step gets advice
_SMALL_BUCKET_BYTES = 1 << 20


def kind_of(kind, what):
    """(short name, category) of a collective of `kind` (a Collective's name) described as `what`."""
    collective = Collective[kind]
    return collective.named(what), collective.category


def _arrivals(by_rank, offsets):
    """{sequence: (latest arrival on the master's clock, rank that arrived last)} of the worker's collectives."""
    latest = {}
    for rank, events in enumerate(by_rank):
        for event in events:
            if event[0] in ("collective", "bucket"):
                arrival = event[-2] - offsets[rank]
                if event[1] not in latest or arrival > latest[event[1]][0]:
                    latest[event[1]] = (arrival, rank)
    return latest


def chrome_events(by_rank, offsets, origin):
    """Chrome trace events ("X" slices, "i" instants; times in us on the master's clock) of
    every rank's events, with each worker collective split into waiting for the latest rank and
    transfer."""
    latest = _arrivals(by_rank, offsets)
    out = []
    for rank, events in enumerate(by_rank):
        def us(t):
            return (t - offsets[rank] - origin) / 1e3

        def add(name, category, row, start, end, **args):
            out.append({"name": name, "cat": category, "ph": "X", "pid": rank, "tid": row, "ts": us(start),
                        "dur": max(0.0, (end - start) / 1e3), "args": args})

        arrivals = _input_arrivals(events)
        steps = sorted((e for e in events if e[0] == "step"), key=lambda e: e[2])
        counts = {}
        for number, (_, kind, start, end, first) in enumerate(steps):
            counts[kind] = counts.get(kind, 0) + 1
            add(f"{kind} {counts[kind]}" + " (traces the step)" * first, "step", MAIN_ROW, start, end)
            arrived = _first_within(arrivals, start, end)
            if arrived is not None:
                add("waiting for input", "input", MAIN_ROW, start, arrived)
            if number + 1 < len(steps):
                add("callbacks and Keras' loop", "callbacks", MAIN_ROW, end, steps[number + 1][2])
        for event in events:
            if event[0] == "blocked":
                _, row, kind, what, start, end = event
                name, category = kind_of(kind, what)
                add(name, category, row, start, end, what=what)
            elif event[0] in ("collective", "bucket"):
                if event[0] == "collective":
                    _, sequence, kind, what, start, end = event
                    name, category = kind_of(kind, what)
                    args = {"what": what}
                else:
                    _, sequence, index, nbytes, start, end = event
                    name, category, args = f"bucket {index}", "gradients", {"bytes": nbytes, "bucket": index}
                arrival, last = latest[sequence]
                ready = max(start, arrival + offsets[rank])
                add(name, category, WORKER_ROW, start, end, collective=sequence, **args)
                if ready > start:
                    add(f"waiting for rank {last}", "waiting", WORKER_ROW, start, ready)
                add("transfer", "transfer", WORKER_ROW, ready, end)
            elif event[0] == "handover":
                out.append({"name": f"hand-over of bucket {event[1]}", "cat": "gradients", "ph": "i", "s": "t",
                            "pid": rank, "tid": OPS_ROW, "ts": us(event[2])})
            elif event[0] == "span":
                add(event[1], "save", MAIN_ROW, event[2], event[3])
    return out


# -- the step report --------------------------------------------------------------------------

def _input_arrivals(events):
    """Sorted times at which steps had their batch: recorded arrivals, and the start of each
    step opening's collective (it waits for the batch, and nothing else does before it)."""
    return sorted([e[1] for e in events if e[0] == "input"] +
                  [e[4] for e in events if e[0] == "blocked" and e[2] == Collective.STEP_OPENING.name])


def _first_within(times, low, high):
    first = bisect.bisect_left(times, low)
    return times[first] if first < len(times) and times[first] <= high else None


def _overlap(intervals, starts, low, high):
    """Total length of the sorted, disjoint `intervals` (with their `starts`) inside [low, high]."""
    total = 0
    for position in range(max(0, bisect.bisect_right(starts, low) - 1), len(intervals)):
        start, end = intervals[position]
        if start >= high:
            break
        total += max(0, min(end, high) - max(start, low))
    return total


def step_breakdown(by_rank, offsets):
    """Per rank, a list with one dict per training step: ms of the step, of compute, input wait,
    communication not hidden by compute (per category too), and waiting for the slowest rank;
    bucket bytes and count."""
    latest = _arrivals(by_rank, offsets)
    result = []
    for rank, events in enumerate(by_rank):
        waits = sorted((e[-2], latest[e[1]][0] + offsets[rank]) for e in events
                       if e[0] in ("collective", "bucket") and latest[e[1]][0] + offsets[rank] > e[-2])
        wait_starts = [start for start, _ in waits]
        blocked = sorted((e[4], e[5], kind_of(e[2], e[3])[1]) for e in events if e[0] == "blocked")
        blocked_starts = [start for start, _, _ in blocked]
        buckets = sorted((e[4], e[3]) for e in events if e[0] == "bucket")
        bucket_starts = [start for start, _ in buckets]
        arrivals = _input_arrivals(events)
        steps = []
        # A training function's first call traces the step: not a step like the others.
        for event in sorted(e for e in events if e[0] == "step" and e[1] == "training step" and not e[4]):
            _, _, start, end, _ = event
            arrived = _first_within(arrivals, start, end)
            row = {"step": end - start, "input": 0 if arrived is None else arrived - start, "waiting": 0,
                   "unhidden": 0, "by_category": {}}
            for position in range(bisect.bisect_left(blocked_starts, start), len(blocked)):
                block_start, block_end, category = blocked[position]
                if block_start > end:
                    break
                length = min(block_end, end) - block_start
                waited = _overlap(waits, wait_starts, block_start, min(block_end, end))
                row["waiting"] += waited
                row["unhidden"] += length - waited
                row["by_category"][category] = row["by_category"].get(category, 0) + length - waited
            row["compute"] = row["step"] - row["input"] - row["waiting"] - row["unhidden"]
            inside = buckets[bisect.bisect_left(bucket_starts, start):bisect.bisect_right(bucket_starts, end)]
            row["bucket_bytes"] = [nbytes for _, nbytes in inside]
            steps.append(row)
        result.append(steps)
    return result


def step_report(by_rank, offsets, hosts, fusion_threshold_bytes=None, threshold_chosen=None):
    """The table printed after fit: per rank, ms per step and % of the step; the straggler, if one
    rank holds the others up consistently; one line on what would help. None without training steps.
    `threshold_chosen` says in words how the fusion threshold was chosen."""
    breakdown = step_breakdown(by_rank, offsets)
    counts = {len(steps) for steps in breakdown}
    if not counts or 0 in counts:
        return None
    steps = min(counts)
    columns = [("compute", "compute"), ("input", "input wait"), ("unhidden", "communication not hidden"),
               ("waiting", "waiting for the slowest rank")]
    means = [{key: statistics.fmean(row[key] for row in rows[:steps]) / 1e6 for key in
              ("step", "compute", "input", "unhidden", "waiting")} for rows in breakdown]
    threshold = "" if fusion_threshold_bytes is None else f"; fusion threshold {fusion_threshold_bytes / 1024:g} KB"
    if threshold and threshold_chosen:
        threshold += f" ({threshold_chosen})"
    lines = [f"tarantella timeline: {steps} training steps on {len(breakdown)} rank(s) (the first, which traces, "
             f"left out){threshold}; ms per step (% of the step)",
             f"{'rank':<6}{'step':>9}" + "".join(f"  {title:>{max(len(title), 14)}}" for _, title in columns)]
    for rank, mean in enumerate(means):
        cells = [_ms_and_share(mean[key], mean["step"]).rjust(max(len(title), 14)) for key, title in columns]
        lines.append(f"{rank:<6}{mean['step']:>9.2f}  " + "  ".join(cells))
    straggler = _straggler(breakdown, steps, means)
    if straggler is not None:
        rank, blame, others_wait = straggler
        lines.append(f"Straggler: rank {rank} (host {hosts[rank]}): {blame:.0%} of the other ranks' waiting was for "
                     f"it, {others_wait:.2f} ms per step.")
    lines.append("What would help: " + _advice(breakdown, steps, means, straggler, hosts, fusion_threshold_bytes))
    return "\n".join(lines)


def _ms_and_share(ms, step_ms):
    return f"{ms:.2f} ({ms / step_ms * 100:.0f}%)" if step_ms else "-"


def _straggler(breakdown, steps, means):
    """(rank, share of the others' waiting that was for it, the others' mean wait in ms) or None.

    In each step the slowest rank is the one that spent longest without waiting for another;
    the other ranks' waiting in that step is put down to it."""
    ranks = len(breakdown)
    if ranks < 2:
        return None
    blame = [0.0] * ranks
    for k in range(steps):
        slowest = max(range(ranks), key=lambda r: breakdown[r][k]["step"] - breakdown[r][k]["waiting"])
        blame[slowest] += sum(breakdown[r][k]["waiting"] for r in range(ranks) if r != slowest) / (ranks - 1)
    rank = max(range(ranks), key=blame.__getitem__)
    others = [mean for r, mean in enumerate(means) if r != rank]
    others_wait = statistics.fmean(mean["waiting"] for mean in others)
    others_step = statistics.fmean(mean["step"] for mean in others)
    share = blame[rank] / sum(blame) if sum(blame) else 0.0
    if share >= _STRAGGLER_BLAME and others_step and others_wait / others_step >= _STRAGGLER_WAIT:
        return rank, share, others_wait
    return None


def _advice(breakdown, steps, means, straggler, hosts, fusion_threshold_bytes):
    step = statistics.fmean(mean["step"] for mean in means)
    if straggler is not None:
        rank = straggler[0]
        others = [mean for r, mean in enumerate(means) if r != rank]
        extra_input = means[rank]["input"] - statistics.median(m["input"] for m in others)
        extra_compute = means[rank]["compute"] - statistics.median(m["compute"] for m in others)
        if extra_input >= extra_compute:
            return (f"rank {rank}'s input pipeline: it waits {means[rank]['input']:.2f} ms per step for input, the "
                    f"others {statistics.median(m['input'] for m in others):.2f} ms. Speed up its tf.data pipeline "
                    "(map(..., num_parallel_calls=tf.data.AUTOTUNE), prefetch, cache) or its storage.")
        return (f"a slow host: rank {rank} computes {extra_compute:.2f} ms per step longer than the others. Check "
                f"what else runs on {hosts[rank]}, and how the ranks are bound to cores (--pin-to-socket).")
    input_wait = statistics.fmean(mean["input"] for mean in means)
    if step and input_wait / step >= _NOTABLE:
        return (f"the input pipeline: the ranks wait {input_wait:.2f} ms per step for input "
                "(map(..., num_parallel_calls=tf.data.AUTOTUNE), prefetch, cache).")
    unhidden = statistics.fmean(mean["unhidden"] for mean in means)
    if not step or unhidden / step < _NOTABLE:
        return f"nothing stands out: compute is {statistics.fmean(m['compute'] for m in means) / step:.0%} of the step."
    by_category = {}
    for rows in breakdown:
        for row in rows[:steps]:
            for category, value in row["by_category"].items():
                by_category[category] = by_category.get(category, 0) + value / 1e6 / steps / len(breakdown)
    if by_category.get("batchnorm", 0) >= unhidden / 2:
        return (f"fewer synchronized BatchNormalization layers: their collectives leave {by_category['batchnorm']:.2f} "
                "ms per step unhidden (tnt.Model(..., synchronized_batch_normalization=False), or synchronize "
                "only some layers: layer.synchronized = True).")
    sizes = [nbytes for rows in breakdown for row in rows[:steps] for nbytes in row["bucket_bytes"]]
    per_step = len(sizes) / steps / len(breakdown)
    if sizes and per_step > 4 and statistics.median(sizes) < _SMALL_BUCKET_BYTES:
        now = "" if fusion_threshold_bytes is None else f", now {fusion_threshold_bytes / 1024:g} KB"
        return (f"a higher fusion threshold (--fusion-threshold KB or TNT_FUSION_THRESHOLD{now}): {per_step:.0f} "
                f"gradient buckets per step, of {statistics.median(sizes) / 1024:.0f} KB (median), leave "
                f"{unhidden:.2f} ms per step unhidden.")
    return (f"little on tarantella's side: {unhidden:.2f} ms per step of communication ({sum(sizes) / steps / len(breakdown) / 1e6:.1f} "
            "MB of gradients) is not hidden by compute; a larger micro-batch hides more of it.")
