"""Gradients summed over the ranks inside jitted JAX code: the built-in step's, a custom step's and a
custom loop's (`tnt.optimizers` under `jax.jit`).

The gradients travel in fused buckets (the plan of backends/fusion.py, last layer first). A gradient
that alone reaches the fusion threshold is its own bucket, handed over unconcatenated. The sum is a
`buffer_callback` whose outputs alias its inputs: the communicator's worker thread sums each bucket
in place, in the very buffer XLA computed it in, so nothing is copied in or out and no fresh output
buffer is allocated (for the MLP of benchmarks/scaling.py, faulting in 40 MB of fresh output each
step cost more than its ring allreduce). On a GPU the buckets are an ordered `io_callback`'s
instead: JAX copies them to the host and their sums back.

That one callback runs after the whole backprop. Per bucket (`hands_over_per_bucket`: across
nodes, or TNT_JAX_GRADIENT_HANDOVER=per-bucket), each bucket has its own `buffer_callback`, output
aliased to input, which hands XLA's buffer to the reducer and returns at once, so the worker sums
it while backprop goes on (XLA runs it a layer or two after it computed the bucket); one last
callback takes every handed-over buffer, its outputs aliased to them, waits for the round, and
only its outputs reach the optimizer. The worker writes a buffer after its hand-over returned,
while XLA runs on: that is safe while XLA neither copies, reads nor frees it. Nothing but the last
callback reads a handed-over buffer, which keeps it alive; that XLA did not copy it on the way
(to honour an alias it cannot keep) is checked each step: the last callback finds the very
addresses the worker summed in, as its inputs and outputs, or raises. A copy before a hand-over
callback (where XLA still needs the gradient itself) is harmless: the callback then hands over
the copy. A rank without samples sends zeros after backprop, in the one-callback form: the
rounds of both forms are the same on the wire.

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
from tarantella.common import config


class BucketSum:
    """Sums lists of gradients over the ranks in fused buckets, through `reducer`."""

    def __init__(self, reducer, threshold_bytes, per_bucket):
        self._reducer = reducer
        self._threshold_bytes = threshold_bytes
        # On the CPU the sum reads and writes XLA's own buffers; a GPU's must be copied.
        self._in_host_memory = jax.default_backend() == "cpu"
        self._per_bucket = per_bucket and self._in_host_memory

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
            sequence.append(fusion.round_description(layout.names(), self._reducer.reduction.wire))
        specs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buckets]
        conditional = only_if is not None
        if self._per_bucket and contributes:
            summed = self._sum_as_computed(buckets, agreed, after, waited_for[-1:] if conditional else ())
        elif self._in_host_memory:
            summed = buffer_callback(functools.partial(self._sum_in_place, agreed, conditional), specs,
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

    def _sum_as_computed(self, buckets, agreed, after, only_if):
        """The sums of `buckets`, each handed to the worker by its own callback as soon as XLA has
        computed it; one last callback, whose outputs alias the buckets, waits for the round
        (`only_if`: () or a traced bool as one element; where False, nothing is handed over)."""
        # A bucket's callback is in no ordered chain: a fence runs every ordered callback traced
        # before the sum (the opening, loss divisors, synchronized BatchNormalization's backward
        # allreduces) before the first hand-over, as the worker must issue their collectives first.
        ordered_before = (_fence(),) + tuple(after) + tuple(only_if)
        count = len(buckets)
        conditional = bool(only_if)
        handed = [buffer_callback(functools.partial(self._hand_over, index, count, agreed, conditional),
                                  jax.ShapeDtypeStruct(bucket.shape, bucket.dtype), has_side_effect=True,
                                  input_output_aliases={0: 0})(bucket, *ordered_before)
                  for index, bucket in enumerate(buckets)]
        return buffer_callback(functools.partial(self._wait_for_round, conditional),
                               [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in handed], has_side_effect=True,
                               input_output_aliases={i: i for i in range(count)})(*handed, *only_if)

    def _hand_over(self, index, count, agreed, conditional, context, bucket, *unread):
        """Hands bucket `index` to the worker, which sums it in XLA's buffer after this returns
        (`conditional`: unless the last input is False)."""
        if conditional and not np.asarray(unread[-1]):
            return
        self._reducer.submit(index, count, np.asarray(bucket).reshape(-1), agreed=agreed)

    def _wait_for_round(self, conditional, context, sums, *handed):
        """Waits until the worker has summed every bucket. XLA gave each hand-over's output buffer
        to this callback's input and output (the same addresses) without copying it while the
        worker wrote it; should a version of XLA ever copy it, the sums are not trusted: stop."""
        if conditional:
            handed, summing = handed[:-1], np.asarray(handed[-1])
            if not summing:
                return
        summed = self._reducer.collect()
        for index, (total, bucket, worked_on) in enumerate(zip(sums, handed, summed)):
            addresses = {_address(np.asarray(total)), _address(np.asarray(bucket)), _address(worked_on)}
            if len(addresses) > 1:
                raise RuntimeError(
                    f"gradient bucket {index} was moved by XLA while tarantella summed it over the ranks in place "
                    f"(this JAX {jax.__version__} does not keep a buffer_callback's aliased buffers), so this step's "
                    "gradients cannot be trusted. Set TNT_JAX_GRADIENT_HANDOVER=after-backprop for the job, and "
                    "please report this tarantella bug with your JAX version.")

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


def _address(array):
    return array.__array_interface__["data"][0]


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
    summed = BucketSum(reducer, threshold_bytes, hands_over_per_bucket()).fenced(wire, contributes=True)
    divisor = None
    if loss_reduction != "sum":
        divisor = summed.pop()[0] if samples is not None else jnp.float32(ranks)
    result = list(grads)
    for i, total in zip(present, summed):
        if divisor is not None:
            total = jnp.where(divisor > 0, total / divisor.astype(total.dtype), jnp.zeros_like(total))
        result[i] = total.astype(grads[i].dtype)
    return result


def hands_over_per_bucket():
    """Whether each gradient bucket goes to the worker as XLA computes it: TNT_JAX_GRADIENT_HANDOVER,
    and where that is 'auto', across nodes only (measured: docs/performance.md, "JAX: buckets as XLA
    computes them"), the same on every rank."""
    chosen = config.jax_gradient_handover()
    if chosen != "auto":
        return chosen == "per-bucket"
    from tarantella.runtime import world
    return world.node_share().nodes > 1
