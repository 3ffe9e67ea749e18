"""The TensorFlow ops that reduce a step's gradients in the buckets of the fusion plan
(`backends.fusion`): each bucket is handed to the reducer as soon as backprop has computed it,
and the reducer's worker sums the buckets strictly in plan order.

Sparse gradients (`tf.IndexedSlices`, e.g. from an Embedding) are not summed but
gathered: every rank gets the slices of all ranks, so the optimizer sees each looked-up
row once per occurrence, as in a serial step on the global batch. Keras' Adam, RMSprop
and others treat repeated rows differently from one summed row, so densifying would
change the result.
"""

import functools

import numpy as np
import tensorflow as tf

from tarantella.backends import fusion
from tarantella.runtime import events

class GradientAllreduce:
    """Sums gradients over all ranks inside a traced training step."""

    def __init__(self, reducer, threshold_bytes):
        self._reducer = reducer
        self._threshold_bytes = threshold_bytes

    def __call__(self, gradients, variables=None, contributes=None, step_sequence=None, opening=None):
        """Sums `gradients` over ranks; None entries stay None.

        `step_sequence` (a list, optional): the collectives of the step being traced, whose opening
        agrees on all of them; this round adds itself there and needs no agreement of its own.

        `opening` (optional, with `step_sequence`): (samples, divisor, arrived), the rank's sample
        count (an integer scalar tensor), the float64 guess of the global batch size B that its
        loss was divided by, and for the timeline the tf.timestamp() of the batch's arrival (or 0).
        The round then opens the step (Reducer.submit) and returns (gradients, B as a
        float64 scalar tensor).

        `contributes` (a boolean scalar tensor, optional): where False, this rank adds zeros
        instead of its gradients (a rank without samples, whose gradients may hold NaN). They
        are zeroed in the buffers handed over, so the common case costs no pass over them.

        The sums are written into the buffers handed over, so pass tensors computed in the
        step (gradients times a weight): a gradient TensorFlow folded into a constant would
        be summed into again at every step.

        With `variables` (aligned with `gradients`), each gradient takes its variable's
        shape: some ops (an einsum over a 3-D input) leave a gradient's static shape partly
        unknown. Without, the gradients' static shapes must be fully known."""
        if variables is None:
            variables = gradients
        backprop_order = [i for i in reversed(range(len(gradients))) if gradients[i] is not None]
        sparse = {i for i in backprop_order if isinstance(gradients[i], tf.IndexedSlices)}
        dense = {i: self._to_wire(tf.reshape(gradients[i], variables[i].shape))
                 for i in backprop_order if i not in sparse}
        sizes = {i: int(np.prod(variables[i].shape)) for i in dense}
        layout = fusion.BucketLayout(sizes, {i: dense[i].dtype.name for i in dense}, self._threshold_bytes,
                                     [i for i in backprop_order if i not in sparse])
        # Sparse gradients go last: backprop reaches embeddings (the first layers) last.
        items = [[i for i, _, _ in members] for _, _, members in layout.buckets] + [
            [i] for i in backprop_order if i in sparse]
        if not items:
            if opening is not None:
                raise ValueError("A gradient round without gradients cannot open its step.")
            return list(gradients)

        contributes = tf.constant(True) if contributes is None else contributes
        agreed = step_sequence is not None
        samples, divisor, arrived = [tf.constant(0, tf.int64), tf.constant(0.0, tf.float64),
                                     tf.constant(0.0, tf.float64)] if opening is None else [
            tf.cast(opening[0], tf.int64), tf.cast(opening[1], tf.float64), tf.cast(opening[2], tf.float64)]
        opens = step_sequence if opening is not None else None
        if agreed:
            sparse_names = ["sparse"] * (len(items) - len(layout.buckets))
            step_sequence.append(fusion.round_description(layout.names() + sparse_names, self._reducer.reduction.wire))
        handed_over, result_dtypes = [], []
        for index, members in enumerate(items):
            submit = functools.partial(self._submit, index, len(items), agreed, opens)
            with tf.control_dependencies(handed_over[-1:]):
                inputs = self._bucket_inputs(members, gradients, dense, sparse)
            result_dtypes += [tensor.dtype for tensor in inputs]
            handed_over.append(tf.numpy_function(submit, [contributes, samples, divisor, arrived] + inputs, tf.int64,
                                                 stateful=True, name=f"tnt_submit_bucket_{index}"))
        collected = tf.numpy_function(functools.partial(self._collect, opening is not None), handed_over,
                                      result_dtypes + [tf.float64] * (opening is not None), stateful=True,
                                      name="tnt_collect_buckets")
        reduced = iter(collected)

        result = list(gradients)
        for members in items:
            first = members[0]
            if first in sparse:
                slices = gradients[first]
                indices, values = next(reduced), next(reduced)
                indices.set_shape([None])
                values.set_shape([None] + slices.values.shape[1:])
                result[first] = tf.IndexedSlices(tf.cast(values, slices.values.dtype),
                                                 tf.cast(indices, slices.indices.dtype), slices.dense_shape)
                continue
            flat = next(reduced)
            member_sizes = [sizes[i] for i in members]
            flat.set_shape([sum(member_sizes)])
            pieces = tf.split(flat, member_sizes) if len(members) > 1 else [flat]
            for i, piece in zip(members, pieces):
                result[i] = tf.cast(tf.reshape(piece, variables[i].shape), gradients[i].dtype)
        if opening is None:
            return result
        global_samples = next(reduced)
        global_samples.set_shape([])
        return result, global_samples

    def _bucket_inputs(self, members, gradients, dense, sparse):
        """The tensors one bucket hands over: a sparse gradient's indices and values, or one flat
        buffer that the allreduce overwrites with the sum.

        The caller builds them under a control dependency on the previous bucket's hand-over, so
        that TensorFlow cannot merge two buckets' buffers into one: two layers can have equal
        gradients (two Dense layers on the same input, added), and Grappler merges ops that
        compute the same thing. One buffer handed over twice would be summed over the ranks twice."""
        if members[0] in sparse:
            slices = gradients[members[0]]
            return [tf.cast(slices.indices, tf.int64), self._to_wire(slices.values)]
        if len(members) > 1:
            return [tf.concat([tf.reshape(dense[i], [-1]) for i in members], axis=0)]
        # The allreduce writes in place; Snapshot copies only if backprop still reads the buffer.
        return [tf.raw_ops.Snapshot(input=tf.reshape(dense[members[0]], [-1]))]

    @staticmethod
    def _to_wire(gradient):
        return tf.cast(gradient, fusion.wire_dtype(gradient.dtype.name))

    def _submit(self, index, count, agreed, opens, contributes, samples, divisor, arrived, *arrays):
        if not contributes:
            if len(arrays) == 1:  # a dense bucket: its own buffer (see _bucket_inputs), summed in place
                arrays[0].fill(0)
            else:  # a sparse gradient: its rows stay (ranks compare them), with zero values; a new
                # array, as TensorFlow may share the values' buffer
                arrays = (arrays[0], np.zeros_like(arrays[1]))
        payload = arrays[0] if len(arrays) == 1 else tuple(arrays)
        opening = None if opens is None else ("; ".join(opens), int(samples), float(divisor))
        if arrived and events.observer is not None:
            events.observer.input_arrived(float(arrived))
        self._reducer.submit(index, count, payload, agreed, opening)
        return np.int64(index)

    def _collect(self, opened, *handed_over):
        flat = []
        for item in self._reducer.collect():
            flat.extend(item if isinstance(item, tuple) else [item])
        if opened:
            flat.append(np.float64(self._reducer.global_samples))
        return flat


def loop_sum(grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks):
    """`tnt.optimizers.allreduce_gradients` on TensorFlow, eagerly or inside a `tf.function`: each
    gradient times the rank's sample count, summed with the count in one `GradientAllreduce` round
    and divided by the global count (tarantella/optimizers.py has the contract)."""
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    samples = None if num_samples is None else tf.cast(tf.reshape(num_samples, []), tf.float64)
    # The allreduce writes into the buffers handed to it, and TensorFlow may fold a gradient
    # (or a static sample count) into a constant whose buffer every later step reuses. A factor
    # from DeepCopy, which TensorFlow never folds, makes each handed-over buffer new.
    weight = tf.raw_ops.DeepCopy(x=samples if samples is not None and loss_reduction == "mean"
                                 else tf.constant(1.0, tf.float64))
    wire = []
    for g in grads:
        if g is not None:
            g = tf.cast(g, fusion.wire_dtype(g.dtype.name))  # and m_r * g_r could overflow 16 bits
            g = g * tf.cast(weight, g.dtype)
            if samples is not None:  # 0 * NaN is NaN: a rank without samples must send zeros
                g = tf.where(samples > 0, g, tf.zeros_like(g))
        wire.append(g)
    if samples is not None:
        wire.append(tf.reshape(tf.raw_ops.DeepCopy(x=samples), [1]))
    shapes = None
    if variables is not None:
        shapes = [tf.TensorSpec(v.shape) for v in variables] + ([wire[-1]] if samples is not None else [])
    summed = GradientAllreduce(reducer, threshold_bytes)(wire, shapes)
    global_batch = summed.pop()[0] if num_samples is not None else None
    if loss_reduction == "sum":
        divisor = None
    else:
        divisor = global_batch if global_batch is not None else tf.constant(ranks, tf.float64)
    result = []
    for original, total in zip(grads, summed):
        if original is None:
            result.append(None)
            continue
        if divisor is not None:
            total = tf.math.divide_no_nan(total, tf.cast(divisor, total.dtype))
        result.append(tf.cast(total, original.dtype))
    return result
