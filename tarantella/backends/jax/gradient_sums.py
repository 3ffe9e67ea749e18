"""Gradients summed over the ranks inside jitted JAX code: the built-in step's, a custom step's and a
custom loop's (`tnt.optimizers` under `jax.jit`).

The gradients travel in fused buckets (the plan of backends/fusion.py, last layer first). A gradient
that alone reaches the fusion threshold is its own bucket, handed over unconcatenated. The sum is a
`buffer_callback` whose outputs alias its inputs: the communicator's worker thread sums each bucket
in place, in the very buffer XLA computed it in, so nothing is copied in or out and no fresh output
buffer is allocated (for the MLP of benchmarks/scaling.py, faulting in 40 MB of fresh output each
step cost more than its ring allreduce). On a GPU the buckets are an ordered `io_callback`'s
instead: JAX copies them to the host and their sums back.

A `buffer_callback` is in no ordered chain of callbacks: its inputs place it. Where other ordered
callbacks may come before and after it in the same jitted code (a custom step, a loop), `fenced`
puts it between two ordered callbacks that communicate nothing: the first one's result is an input
of the sum, and the second takes a piece of the sum's result, so every ordered callback traced
before the sum runs before it, and every one traced after runs after it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback

from tarantella.backends import fusion


class BucketSum:
    """Sums lists of gradients over the ranks in fused buckets, through `reducer`."""

    def __init__(self, reducer, threshold_bytes):
        self._reducer = reducer
        self._threshold_bytes = threshold_bytes
        # On the CPU the sum reads and writes XLA's own buffers; a GPU's must be copied.
        self._in_host_memory = jax.default_backend() == "cpu"

    def __call__(self, grads, contributes, sequence=None, after=(), only_if=None):
        """The sum over ranks of `grads` (arrays), and one summed element that later collectives
        take as an input, so that they run after this one (None where nothing was summed).

        Args:
            grads: this rank's arrays; a rank whose `contributes` is False sends zeros (its zero
                row's gradients may hold NaN).
            contributes: whether this rank has samples (a Python bool: shapes are static).
            sequence: the step's list of collectives, which its opening agreed on; None: the
                round agrees on its own buckets (a custom loop, which has no opening).
            after: arrays the sum receives unread, to run after what computes them.
            only_if: a traced bool; where False, the round is skipped and `grads` come back as
                they are (a micro-step of gradient accumulation, backends/accumulation.py).
        """
        wire = [g.astype(fusion.wire_dtype(g.dtype.name)) for g in grads]
        layout = fusion.BucketLayout([g.size for g in wire], [g.dtype.name for g in wire], self._threshold_bytes,
                                     list(reversed(range(len(grads)))))
        members = [[index for index, _, _ in bucket_members] for _, _, bucket_members in layout.buckets]
        if not members:
            return list(grads), None
        buckets = [wire[bucket[0]] if len(bucket) == 1 else jnp.concatenate([jnp.ravel(wire[i]) for i in bucket])
                   for bucket in members]
        # A rank that sends zeros passes its gradients too, unread: they stay after backprop's callbacks.
        waited_for = tuple(after) + (() if contributes else tuple(buckets))
        if only_if is not None:  # the last input, which the callback reads
            waited_for += (jnp.asarray(only_if, jnp.bool_),)
        if not contributes:
            buckets = [jnp.zeros_like(b) for b in buckets]
        agreed = sequence is not None
        if agreed:
            sequence.append(fusion.round_description(layout.names()))
        specs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buckets]
        if self._in_host_memory:
            summed = buffer_callback(functools.partial(self._sum_in_place, agreed, only_if is not None), specs,
                                     has_side_effect=True,
                                     input_output_aliases={i: i for i in range(len(buckets))})(*buckets, *waited_for)
        else:  # a GPU's buffers: JAX copies the buckets to the host and the sums back
            summed = io_callback(functools.partial(self._sum_copies, agreed, only_if is not None, len(buckets)), specs,
                                 *buckets, *waited_for, ordered=True)
        result = list(grads)
        for (_, _, bucket_members), total in zip(layout.buckets, summed):
            if len(bucket_members) == 1:
                result[bucket_members[0][0]] = total.astype(grads[bucket_members[0][0]].dtype)
                continue
            for i, offset, size in bucket_members:
                result[i] = total[offset:offset + size].reshape(grads[i].shape).astype(grads[i].dtype)
        return result, jnp.ravel(summed[0])[:1]

    def fenced(self, grads, contributes, sequence=None):
        """`self(...)`'s sums, placed between the ordered callbacks traced before and after it."""
        summed, token = self(grads, contributes, sequence=sequence, after=(_fence(),))
        if token is not None:
            _fence(token)
        return summed

    def _sum_in_place(self, agreed, conditional, context, sums, *buckets_and_unread):
        """Sums every bucket over ranks where it lies: each of `sums` is XLA's buffer of its
        bucket, valid while this runs (`conditional`: unless the last input is False)."""
        if conditional and not np.asarray(buckets_and_unread[-1]):
            return
        self.sum_flat([np.asarray(total).reshape(-1) for total in sums], agreed)

    def _sum_copies(self, agreed, conditional, count, *buckets_and_unread):
        """The sums over ranks of the first `count` arrays, host copies of a GPU's buckets
        (`conditional`: unless the last input is False)."""
        buckets = buckets_and_unread[:count]
        sums = [np.array(bucket).reshape(-1) for bucket in buckets]
        if not conditional or np.asarray(buckets_and_unread[-1]):
            self.sum_flat(sums, agreed)
        return [total.reshape(np.shape(bucket)) for total, bucket in zip(sums, buckets)]

    def sum_flat(self, arrays, agreed=True):
        """Sums each 1-D array over ranks in place, as one round of gradient buckets (`agreed`: the
        step's opening agreed on it; else the round agrees on its own)."""
        for index, array in enumerate(arrays):
            self._reducer.submit(index, len(arrays), array, agreed=agreed)
        self._reducer.collect()


def _fence(*after):
    """An ordered callback that communicates nothing: its place in the chain of ordered callbacks
    orders what takes its result, or what it takes, against the rest of the chain."""
    return io_callback(_nothing, jax.ShapeDtypeStruct((), jnp.int32), *after, ordered=True)


def _nothing(*unread):
    return np.int32(0)


def loop_sum(reducer, threshold_bytes, ranks, grads, num_samples, loss_reduction):
    """`tnt.optimizers.allreduce_gradients` inside jitted code: the arithmetic of
    backends/loop_gradients.py on traced arrays, the round a fenced `BucketSum` that agrees on its
    own buckets (a loop has no step opening)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    samples = None if num_samples is None else jnp.reshape(jnp.asarray(num_samples, jnp.float32), ())
    weight = samples if samples is not None and loss_reduction == "mean" else None
    wire = []
    for i in present:
        g = grads[i].astype(fusion.wire_dtype(grads[i].dtype.name))
        if weight is not None:
            g = g * weight.astype(g.dtype)
        if samples is not None:  # 0 * NaN is NaN: a rank without samples sends zeros
            g = jnp.where(samples > 0, g, jnp.zeros_like(g))
        wire.append(g)
    if samples is not None:
        wire.append(jnp.reshape(samples, (1,)))
    summed = BucketSum(reducer, threshold_bytes).fenced(wire, contributes=True)
    divisor = None
    if loss_reduction != "sum":
        divisor = summed.pop()[0] if samples is not None else jnp.float32(ranks)
    result = list(grads)
    for i, total in zip(present, summed):
        if divisor is not None:
            total = jnp.where(divisor > 0, total / divisor.astype(total.dtype), jnp.zeros_like(total))
        result[i] = total.astype(grads[i].dtype)
    return result
