"""Gradient fusion: a static bucket plan and the TensorFlow ops that reduce it.

Like PyTorch DDP's reducer: gradients are grouped, in the order backprop produces
them (last layer first), into buckets of at least the fusion threshold. Each bucket
is handed to the collectives worker as soon as its gradients exist, so its allreduce
overlaps with the rest of backprop; the worker reduces buckets strictly in plan order.
"""

import functools

import numpy as np
import tensorflow as tf

# MPI has no portable 16-bit float; such gradients travel as float32.
_WIRE_DTYPES = {tf.float32, tf.float64}


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


class GradientAllreduce:
    """Sums gradients over all ranks inside a traced training step."""

    def __init__(self, communicator, threshold_bytes):
        self._comm = communicator
        self._threshold_bytes = threshold_bytes

    def __call__(self, gradients):
        """`gradients` is aligned with the trainable variables; None entries stay None."""
        backprop_order = [i for i in reversed(range(len(gradients))) if gradients[i] is not None]
        dense = {i: self._to_wire(tf.convert_to_tensor(gradients[i])) for i in backprop_order}
        plan = plan_buckets([_nbytes(dense[i]) for i in backprop_order],
                            [dense[i].dtype for i in backprop_order], self._threshold_bytes)
        buckets = [[backprop_order[k] for k in bucket] for bucket in plan]
        if not buckets:
            return list(gradients)

        handed_over = []
        for index, members in enumerate(buckets):
            if len(members) > 1:
                flat = tf.concat([tf.reshape(dense[i], [-1]) for i in members], axis=0)
            else:
                # The allreduce writes in place; Snapshot copies only if backprop still reads the buffer.
                flat = tf.raw_ops.Snapshot(input=tf.reshape(dense[members[0]], [-1]))
            submit = functools.partial(self._submit, index, len(buckets))
            handed_over.append(tf.numpy_function(submit, [flat], tf.int64, stateful=True,
                                                 name=f"tnt_submit_bucket_{index}"))
        reduced = tf.numpy_function(self._collect, handed_over, [dense[m[0]].dtype for m in buckets],
                                    stateful=True, name="tnt_collect_buckets")

        result = list(gradients)
        for members, flat in zip(buckets, reduced):
            sizes = [int(np.prod(dense[i].shape)) for i in members]
            flat.set_shape([sum(sizes)])
            pieces = tf.split(flat, sizes) if len(members) > 1 else [flat]
            for i, piece in zip(members, pieces):
                result[i] = tf.cast(tf.reshape(piece, dense[i].shape), gradients[i].dtype)
        return result

    @staticmethod
    def _to_wire(gradient):
        return gradient if gradient.dtype in _WIRE_DTYPES else tf.cast(gradient, tf.float32)

    def _submit(self, index, count, flat):
        self._comm.submit_bucket(index, count, flat)
        return np.int64(index)

    def _collect(self, *handed_over):
        return self._comm.collect_buckets()


def _nbytes(tensor):
    return int(np.prod(tensor.shape)) * tensor.dtype.size
