"""What tnt.Model checks and does so that every rank trains alike: the ranks compiled the same step
and built the same variables, the master's weights are broadcast, and the features the backend
lacks or tarantella cannot make global are refused on every rank, before any collective.

The compile settings (optimizer class and configuration, losses, metrics, loss weights, ...)
are compared because variable shapes alone cannot tell SGD from RMSprop with the same slots, or
two learning rates: the ranks would end with different weights. The first difference is named.
"""

import keras
import numpy as np

from tarantella.runtime import world


def check_same_compile_settings(comm, model, gradient_wire):
    """Raises ValueError on every rank if the ranks compiled `model` differently, or would send its
    gradients in different types (`gradient_wire`): the bytes they exchange would not match."""
    settings = (model.get_compile_config() if model.compiled else None, gradient_wire)
    everyone = comm.allgather(settings, "the check that all ranks compiled the same training step")
    master = everyone[world.MASTER_RANK]
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != master]
    if not differing:
        return
    rank = differing[0]
    if everyone[rank][1] != master[1]:
        raise ValueError(
            f"The gradient wire differs between ranks (ranks {differing} differ from the master): the gradients "
            f"would travel as {everyone[rank][1]} on rank {rank} but as {master[1]} on the master. Give every rank "
            "the same TNT_GRADIENT_WIRE (the `tarantella` command's -x passes it to all) and the same "
            "tnt.Model(gradient_wire=...).")
    where, theirs, masters = _first_difference(everyone[rank][0], master[0], "compile")
    raise ValueError(
        f"The compiled training step differs between ranks (ranks {differing} differ from the master): "
        f"{where} is {theirs!r} on rank {rank} but {masters!r} on the master. Every rank must compile the "
        "same optimizer (class and settings), loss, metrics and options.")


def _first_difference(theirs, masters, where):
    """(path, their value, the master's value) of the first place where two settings differ."""
    if isinstance(theirs, dict) and isinstance(masters, dict):
        # The class name says more than its settings: compare it first.
        keys = sorted(set(theirs) | set(masters), key=lambda key: (key != "class_name", str(key)))
        for key in keys:
            if theirs.get(key) != masters.get(key):
                return _first_difference(theirs.get(key), masters.get(key), f"{where}[{key!r}]")
    if isinstance(theirs, (list, tuple)) and isinstance(masters, (list, tuple)) and len(theirs) == len(masters):
        for index, (mine, other) in enumerate(zip(theirs, masters)):
            if mine != other:
                return _first_difference(mine, other, f"{where}[{index}]")
    return where, theirs, masters


def check_same_variables_everywhere(comm, variables):
    layout = [(tuple(v.shape), str(v.dtype)) for v in variables]
    layouts = comm.allgather(layout, "the check that all ranks built the same model")
    master = layouts[world.MASTER_RANK]
    differing = [rank for rank, other in enumerate(layouts) if other != master]
    if not differing:
        return
    culprit = differing[0]
    theirs = layouts[culprit]
    common = min(len(theirs), len(master))
    first = next((i for i in range(common) if theirs[i] != master[i]), common)
    detail = (f"rank {culprit} has {len(theirs)} variables, the master {len(master)}" if first == common else
              f"variable #{first} is {theirs[first]} on rank {culprit} but {master[first]} on the master")
    raise ValueError(
        f"The model differs between ranks (ranks {differing} differ from the master): {detail}. "
        "Every rank must build the same model and optimizer, in the same order.")


def broadcast_from_master(comm, variables, what):
    arrays = [np.array(v.numpy(), order="C") for v in variables]
    if not arrays:
        return
    buffer = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    comm.broadcast_bytes(buffer, what)
    start = 0
    for variable, array in zip(variables, arrays):
        stop = start + array.nbytes
        variable.assign(buffer[start:stop].view(array.dtype).reshape(array.shape))
        start = stop


def refuse_what_the_backend_lacks(step, model):
    """Features of tnt.Model that the backend's `step` class lacks: refused on every rank, before any
    collective, so that no rank waits for another."""
    step.check_platform()
    overridden = [method for method in ("train_step", "test_step") if overrides(model, method)]
    if overridden:
        name = step.backend_name
        step.refuse_unless("custom_steps", f"{type(model).__name__} overrides {' and '.join(overridden)}: a custom step",
                           why=f" (tarantella builds the {name} step from Keras' built-in one)",
                           instead="Use the built-in step (customize compute_loss or the metrics instead), or the "
                                   "TensorFlow backend.")


def refuse_ftrl(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.Ftrl):
        raise ValueError(
            "tnt.Model does not support the Ftrl optimizer. Ftrl is an online method that updates "
            "per example (built for sparse linear models); tarantella's contract is one update per "
            "global batch, equal to serial mini-batch training, so, like the original Tarantella, it "
            "refuses Ftrl instead of changing its meaning. Use another optimizer (SGD, Adam, "
            "Adagrad, ...) or train with Ftrl serially.")


def overrides(model, method):
    return getattr(type(model), method) is not getattr(keras.Model, method)
