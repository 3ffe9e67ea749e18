"""Keras' gradient accumulation (an optimizer's `gradient_accumulation_steps=k`) with one sum over
the ranks per k micro-steps, on every backend.

Keras' optimizer keeps an accumulator per variable. On k-1 micro-steps of k it adds the step's
gradient to it; on the k-th, the update step ((iterations + 1) % k == 0), it applies
(gradient + accumulator) / k and zeroes the accumulator. Under tnt.Model, between updates each
rank hands the optimizer its own share-weighted gradient, unsummed: the rank's accumulator holds
its part of serial Keras' accumulator. On the update step the rank sends gradient + accumulator in
its gradient round and zeroes its accumulator before the optimizer adds it, so the optimizer
applies (sum over ranks + 0) / k, serial Keras' update. Every rank runs the same iterations, so all
take the same micro-steps for update steps; the step's opening agrees on which (`described`).

Inside a cycle the ranks' accumulators differ, and their sum over the ranks is serial Keras'
accumulator. Wherever a file may be written, the master first takes that sum and the other ranks
zero theirs (`gather_on_master`, one allreduce on every rank, and nothing where no cycle is under
way), so that what the master saves is serial Keras' state and the next update step still sums
each part once: at the end of `fit`, before a save called on every rank, before each automatic
backup, and before the master's own callbacks may save (model/callbacks.py). Where every rank takes
the master's state (the broadcast after compile, set_weights, a load or a restored backup), the
other ranks zero theirs (`count_on_master_only`).
"""

import keras
import numpy as np

from tarantella.runtime.communicator import MASTER_RANK

NO_ROUND = "no gradient round (an accumulation micro-step)"


def steps(optimizer):
    """k, where `optimizer` accumulates gradients and its rounds may skip micro-steps; else None.

    A LossScaleOptimizer's inner optimizer accumulates gradients the outer one unscales by a
    scale that changes as it goes, and variables overwritten with their gradient (float8
    scales) accumulate a maximum, not a sum: those keep a sum over the ranks on every micro-step,
    which is serial too."""
    k = getattr(optimizer, "gradient_accumulation_steps", None)
    if not k or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    if any(getattr(v, "overwrite_with_gradient", False) for v in getattr(optimizer, "_trainable_variables", ())):
        return None
    return k


def is_update_step(iterations, k):
    """Whether the micro-step at `iterations` (the optimizer's `_iterations`, counting
    micro-steps) applies the accumulated gradients, as Keras' optimizer decides it."""
    return (iterations + 1) % k == 0


def accumulators(optimizer, variables):
    """The optimizer's accumulator of each of `variables`."""
    return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]


def in_gradient_scale(accumulator, optimizer):
    """An accumulator as an update step sends it, added to the gradient: in the gradients' scale
    (the optimizer divides the gradients it gets by its `loss_scale_factor`, but keeps its
    accumulators unscaled)."""
    scale = optimizer.loss_scale_factor
    return accumulator if scale is None else accumulator * scale


class ConditionalRounds:
    """A step's sequence of collectives, to which a gradient round that happens on update steps
    only adds itself: `append` puts (decision index, description) where a round would add its
    description."""

    def __init__(self, sequence, decision):
        self._sequence = sequence
        self._decision = decision

    def append(self, description):
        self._sequence.append((self._decision, description))


def described(sequence, decisions):
    """The sequence's descriptions, with each conditional round's (ConditionalRounds) replaced by
    NO_ROUND where its decision (one bool per accumulating optimizer) says it is skipped."""
    return [entry if isinstance(entry, str) else (entry[1] if decisions[entry[0]] else NO_ROUND)
            for entry in sequence]


def count_on_master_only(communicator, optimizers):
    """Zeroes every accumulator of the accumulating `optimizers` on all ranks but the master, once
    every rank holds the master's state: the master's accumulators then count once."""
    if communicator.rank == MASTER_RANK:
        return
    for optimizer in optimizers:
        if optimizer.built:
            for accumulator in optimizer._accumulated_gradients:
                accumulator.assign(np.zeros(accumulator.shape, keras.backend.standardize_dtype(accumulator.dtype)))


def gather_on_master(communicator, optimizers, everywhere=False):
    """Where a cycle is under way, the master takes the sum over ranks of the accumulators, serial
    Keras' accumulators, and the other ranks zero theirs (one allreduce, on every rank). With
    `everywhere`, every rank takes the sum, for a save that every rank writes; `count_on_master_only`
    must follow it once written."""
    accumulating = [o for o in optimizers if o.built and int(o._iterations.numpy()) % steps(o)]
    variables = [a for o in accumulating for a in o._accumulated_gradients]
    if not variables:
        return
    own = [np.asarray(v.numpy()) for v in variables]
    flat = np.concatenate([value.reshape(-1).astype(np.float64) for value in own])
    summed = communicator.allreduce_sum(flat, "the sum of the gradient accumulators")
    keeps_sum = everywhere or communicator.rank == MASTER_RANK
    offset = 0
    for variable, value in zip(variables, own):
        total = summed[offset:offset + value.size].reshape(value.shape).astype(value.dtype)
        variable.assign(total if keeps_sum else np.zeros_like(total))
        offset += value.size
