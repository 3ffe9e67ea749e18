"""A custom training loop's gradient sum on the host (`tnt.optimizers` on torch, and on JAX outside
jitted code), and the fused round of NumPy arrays it and torch's custom steps send.

For a loss averaged over the micro-batch ("mean"), the serial gradient of the global batch B is
sum over ranks r of (m_r / B) * g_r, B = sum of m_r: each rank sends m_r * g_r together with m_r in
one fused round and divides the two sums (tarantella/optimizers.py has the whole contract). Without
sample counts the ranks weigh alike; for a loss summed over the micro-batch ("sum") the gradients
are summed.
"""

import numpy as np

from tarantella.backends import fusion


def sum_over_ranks(reducer, threshold_bytes, arrays):
    """The sums over ranks of NumPy `arrays`, in one round of fused buckets (last array first) that
    agrees on itself; each comes back in its array's dtype and shape."""
    wire = [np.ascontiguousarray(a, dtype=fusion.wire_dtype(np.asarray(a).dtype.name)).reshape(-1) for a in arrays]
    layout = fusion.BucketLayout([w.size for w in wire], [w.dtype.name for w in wire], threshold_bytes,
                                 list(reversed(range(len(wire)))))
    buffers = []
    for dtype, size, members in layout.buckets:
        buffer = np.empty(size, dtype)
        for i, offset, length in members:
            buffer[offset:offset + length] = wire[i]
        buffers.append(buffer)
    for index, buffer in enumerate(buffers):
        reducer.submit(index, len(buffers), buffer, agreed=False)
    summed = reducer.collect() if buffers else []
    out = [None] * len(arrays)
    for (_, _, members), flat in zip(layout.buckets, summed):
        for i, offset, length in members:
            out[i] = flat[offset:offset + length].reshape(np.shape(arrays[i])).astype(np.asarray(arrays[i]).dtype)
    return out


def summed_gradients(reducer, threshold_bytes, ranks, grads, num_samples, loss_reduction):
    """The global batch's gradients from this rank's `grads` (NumPy arrays or None, which stay None).

    Args:
        reducer: the gradient reducer; threshold_bytes: the fusion threshold; ranks: how many.
        num_samples: this rank's sample count, or None (the ranks weigh alike).
        loss_reduction: "mean" or "sum", as `tnt.optimizers.allreduce_gradients` takes it.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    samples = None if num_samples is None else float(num_samples)
    weight = samples if samples is not None and loss_reduction == "mean" else 1.0
    wire = []
    for i in present:
        g = np.asarray(grads[i])
        g = g.astype(fusion.wire_dtype(g.dtype.name)) * weight
        if samples == 0:  # 0 * NaN is NaN: a rank without samples sends zeros
            g = np.zeros_like(g)
        wire.append(g)
    if samples is not None:
        wire.append(np.array([samples], np.float64))
    summed = sum_over_ranks(reducer, threshold_bytes, wire)
    global_batch = summed.pop()[0] if samples is not None else None
    divisor = None if loss_reduction == "sum" else (global_batch if global_batch is not None else float(ranks))
    result = [None] * len(grads)
    for i, total in zip(present, summed):
        if divisor is not None:
            total = total / divisor if divisor else np.zeros_like(total)
        result[i] = np.asarray(total).astype(np.asarray(grads[i]).dtype)
    return result
