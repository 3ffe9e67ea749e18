"""What every backend's gradient reduction shares: the static bucket plan and the wire's dtypes.

Like PyTorch DDP's reducer: gradients are grouped, in the order backprop produces them (last layer
first), into buckets of at least the fusion threshold, each handed to the reducer as soon as its
gradients exist, so that its sum overlaps with the rest of backprop.
"""

import math

import numpy as np

from tarantella.runtime import reducer

# MPI has no portable 16-bit float: 16-bit values are added as float32, and a 16-bit gradient wire
# (runtime.reducer.SixteenBitWire) moves 16-bit bits as integers.
SIXTEEN_BIT_FLOATS = ("float16", "bfloat16")

# The automatic fusion threshold (TNT_FUSION_THRESHOLD unset). On one node a message costs a few
# microseconds and small buckets start summing early: 32 KiB was the fastest on the 2-rank benchmark.
# Across nodes the ring sums a bucket of s bytes in 2 (p - 1) steps, each costing a message's latency
# alpha plus s / (p beta) of transfer at the link's rate beta: the latencies stay at most 1/16 of the
# transfer where s >= 16 p alpha beta. So the threshold grows with the ranks and with the link's
# latency-bandwidth product, measured at start-up (runtime.link): on 10 GbE (25 us, 1.25 GB/s) that
# is 512 KiB per rank, the emulated cluster's best (8 MiB at 16 ranks). It is rounded up to a power
# of two, so that the small differences between two measurements of one network rarely change it.
# The cap (16 MiB) keeps the last bucket, whose sum no backprop hides, short: with 64 MiB the step
# model projects ResNet-50 at 96-1024 ranks on 10 GbE to 0.86-0.90 of its compute, with 16 MiB to
# 0.90-0.96.
ONE_NODE_THRESHOLD_BYTES = 32 << 10
LATENCY_SHARE = 1 / 16
LARGEST_AUTOMATIC_THRESHOLD_BYTES = 16 << 20


def automatic_threshold_bytes(ranks, nodes, latency_s=None, bytes_per_s=None):
    """The fusion threshold a job of `ranks` ranks on `nodes` nodes gets where the user set none;
    across nodes, from its slowest link's latency (seconds per message) and rate (bytes per second)."""
    if nodes <= 1:
        return ONE_NODE_THRESHOLD_BYTES
    wanted = ranks * latency_s * bytes_per_s / LATENCY_SHARE
    power_of_two = 1 << max(0, math.ceil(math.log2(max(wanted, 1))))
    return min(LARGEST_AUTOMATIC_THRESHOLD_BYTES, max(ONE_NODE_THRESHOLD_BYTES, power_of_two))


def wire_dtype(dtype_name):
    """The name of the dtype in which a gradient (or a value of a collective) of `dtype_name` is
    summed over the ranks: float32 for a 16-bit float, else its own."""
    return "float32" if dtype_name in SIXTEEN_BIT_FLOATS else dtype_name


def gradient_wire(requested, variable_dtypes):
    """The type a model's gradients travel in: `requested` ("float32", "bfloat16" or "float16"), or
    for "auto" the variables' own 16-bit type where every one of `variable_dtypes` (names) is that
    type, else float32, so that a float32 model's sums stay exact unless the user asks otherwise."""
    if requested != "auto":
        return requested
    kinds = set(variable_dtypes)
    return kinds.pop() if len(kinds) == 1 and kinds <= set(SIXTEEN_BIT_FLOATS) else "float32"


def plan_buckets(sizes_in_bytes, dtypes, threshold_bytes):
    """Groups tensors into buckets of at least `threshold_bytes`, in the order they fill up.

    A tensor that alone reaches the threshold travels alone: fusing it would only add a
    copy. Smaller tensors are fused, one dtype per bucket, until they reach the threshold;
    the last bucket may stay smaller. Returns lists of positions into the inputs. A
    threshold of 0 gives one bucket per tensor.
    """
    buckets, pending, pending_bytes = [], [], 0
    for position, (size, dtype) in enumerate(zip(sizes_in_bytes, dtypes)):
        if size >= threshold_bytes:
            buckets.append([position])
            continue
        if pending and dtype != dtypes[pending[-1]]:
            buckets.append(pending)
            pending, pending_bytes = [], 0
        pending.append(position)
        pending_bytes += size
        if pending_bytes >= threshold_bytes:
            buckets.append(pending)
            pending, pending_bytes = [], 0
    if pending:
        buckets.append(pending)
    return buckets


class BucketLayout:
    """Where each gradient of a step lies in the buckets of `plan_buckets`.

    `sizes` (elements) and `dtypes` (the wire dtypes' names) are indexed by gradient; `order` lists
    the indices of the gradients to place, in the order backprop produces them. `buckets` holds,
    per bucket, its dtype name, its size in elements and its members (gradient index, offset,
    size); `place` maps a gradient index to (bucket, offset, size)."""

    def __init__(self, sizes, dtypes, threshold_bytes, order):
        plan = plan_buckets([sizes[i] * np.dtype(dtypes[i]).itemsize for i in order],
                            [dtypes[i] for i in order], threshold_bytes)
        self.buckets = []
        self.place = {}
        for bucket_index, bucket in enumerate(plan):
            members, offset = [], 0
            for position in bucket:
                index = order[position]
                members.append((index, offset, sizes[index]))
                self.place[index] = (bucket_index, offset, sizes[index])
                offset += sizes[index]
            self.buckets.append((dtypes[order[bucket[0]]], offset, members))

    def names(self):
        """Each bucket as "dtype[size]", for the description of a gradient round."""
        return [f"{dtype}[{size}]" for dtype, size, _ in self.buckets]


def round_description(bucket_names, wire):
    """What a step's sequence of collectives says of its gradient round, sent as `wire`."""
    return reducer.round_on_wire("a gradient allreduce of buckets " + ", ".join(bucket_names), wire)
