"""What every backend's gradient reduction shares: the static bucket plan and the wire's dtypes.

Like PyTorch DDP's reducer: gradients are grouped, in the order backprop produces them (last layer
first), into buckets of at least the fusion threshold, each handed to the reducer as soon as its
gradients exist, so that its sum overlaps with the rest of backprop.
"""

# MPI has no portable 16-bit float, so 16-bit values travel, and are added, as float32.
SIXTEEN_BIT_FLOATS = ("float16", "bfloat16")


def wire_dtype(dtype_name):
    """The name of the dtype in which a gradient (or a value of a collective) of `dtype_name` is
    summed over the ranks: float32 for a 16-bit float, else its own."""
    return "float32" if dtype_name in SIXTEEN_BIT_FLOATS else dtype_name


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
