"""Public collectives on tensors, variables and NumPy arrays: allreduce, broadcast, allgather, barrier.

Each call is one job on the communicator's worker thread (`Communicator.run`), so it takes
its place in the one fixed order in which the process issues collectives, after any
gradient round, and a rank waits for it at most TNT_COLLECTIVE_TIMEOUT seconds. Inside a
`tf.function` the job runs from a stateful `tf.numpy_function`; TensorFlow runs such ops
in program order, so every rank issues them in the order the code calls them.

Every call starts by comparing, across the ranks, which collective it is and the dtype and
shape of each value. Ranks that disagree (shapes, dtypes, roots, structure, or a different
collective) all raise the same ValueError, before any data moves: no rank truncates a
message or waits for a partner that will never come. An allgather gathers these layouts (it
needs every rank's row count); the other collectives compare a hash of them in the message
that opens every collective (the agreement) and gather the layouts only when the hashes
differ, to name the mismatch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Literal, Union

import keras
import numpy as np
import tensorflow as tf

from tarantella import collective_calls as calls
from tarantella.runtime import world

__all__ = ["ReductionOp", "TensorAllgatherer", "TensorAllreducer", "TensorBroadcaster", "allgather", "allreduce",
           "barrier", "broadcast", "broadcast_variables"]

# The types of the annotations. One value a collective moves: a tensor or variable, a NumPy array or a
# Python or NumPy number (on the JAX backend a JAX array too), or None, which stays None.
Value = Union[tf.Tensor, tf.Variable, keras.Variable, np.ndarray, np.generic, int, float, complex, bool, None]
# Values, or lists, tuples and dicts of them, nested.
Values = Union[Value, list[Any], tuple[Any, ...], dict[Any, Any]]


class ReductionOp(str, enum.Enum):
    """How allreduce combines the ranks' values; the plain strings ("sum", "mean", ...) work too."""
    SUM = "sum"
    AVERAGE = "mean"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"


@tf.autograph.experimental.do_not_convert
def allreduce(values: Values, op: ReductionOp | Literal["sum", "mean", "prod", "min", "max"] = "sum") -> Values:
    """Combines `values` over all ranks elementwise; every rank gets the result.

    Every rank passes the same structure, shapes and dtypes; results keep them.

    Args:
        values: a tensor, variable, NumPy array or Python number, or a list, tuple or dict of
            them (None entries stay None).
        op: "sum", "mean", "prod", "min" or "max" (or a `tnt.ReductionOp`). "mean" needs
            floating-point or complex values.

    Returns:
        The combined values in the structure of `values` (NumPy arrays for NumPy arrays and
        numbers, tensors for tensors and variables).

    Raises:
        ValueError: `op` is unknown, or the ranks passed different structures, shapes or dtypes.
        TypeError: a value's dtype cannot be reduced with `op`, or a value is neither a tensor,
            variable, array nor number.
        tarantella.CollectiveError: the ranks could not complete the collective (e.g. a rank did not
            take part in time).
    """
    op = _reduction_op(op)
    leaves = calls.leaves_of("allreduce", values)
    for leaf in leaves:
        if leaf is not None:
            calls.check_reducible(leaf.dtype, op)
    return calls.collective("allreduce", values, leaves, lambda comm, arrays, _: calls.allreduce_arrays(comm, arrays, op),
                       lambda shape: shape, detail=op.value)


@tf.autograph.experimental.do_not_convert
def broadcast(values: Values, root: int = 0) -> Values:
    """Every rank gets the `root` rank's `values` (same structure, shapes and dtypes on all ranks).

    Args:
        values: a tensor, variable, NumPy array or Python number, or a list, tuple or dict of
            them (None entries stay None); on the other ranks, values shaped like the root's.
        root: the rank whose values every rank gets.

    Returns:
        The root's values, in the structure of `values`.

    Raises:
        ValueError: `root` is no rank, or the ranks passed different structures, shapes or dtypes.
        TypeError: a value is not numeric or boolean, or is neither a tensor, variable, array nor
            number.
        tarantella.CollectiveError: the ranks could not complete the collective.
    """
    root = calls.check_root(root)
    leaves = calls.leaves_of("broadcast", values)
    for leaf in leaves:
        if leaf is not None:
            calls.check_movable("broadcast", leaf.dtype)
    return calls.collective("broadcast", values, leaves, lambda comm, arrays, _: calls.broadcast_arrays(comm, arrays, root),
                       lambda shape: shape, detail=root)


@tf.autograph.experimental.do_not_convert
def allgather(values: Values) -> Values:
    """Concatenates every rank's `values` along the first axis, in rank order.

    Ranks may pass different first-dimension sizes (0 included); the other dimensions and
    the dtype must agree. A scalar counts as one row: gathering scalars gives a vector with
    one entry per rank.

    Args:
        values: a tensor, variable, NumPy array or Python number, or a list, tuple or dict of
            them (None entries stay None).

    Returns:
        The gathered values, in the structure of `values`.

    Raises:
        ValueError: the ranks passed different structures, dtypes or shapes after the first axis.
        TypeError: a value is not numeric or boolean, or is neither a tensor, variable, array nor
            number.
        tarantella.CollectiveError: the ranks could not complete the collective.
    """
    leaves = calls.leaves_of("allgather", values)
    for leaf in leaves:
        if leaf is not None:
            calls.check_movable("allgather", leaf.dtype)
    return calls.collective("allgather", values, leaves, calls.allgather_arrays, calls.gathered_shape, detail=None,
                       rows_may_differ=True)


@tf.autograph.experimental.do_not_convert
def barrier() -> None:
    """Returns once every rank has called it.

    Raises:
        tarantella.CollectiveError: the ranks could not complete the collective (e.g. a rank did not
            call it in time).
    """
    calls.collective("barrier", [], [], lambda comm, arrays, _: [], lambda shape: shape, detail=None)


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: tf.Variable | keras.Variable | Sequence[tf.Variable | keras.Variable],
                        root: int = 0) -> None:
    """Assigns the `root` rank's values to `variables` (tf.Variable or keras.Variable) on every rank.

    Call it once the variables exist: e.g. `model.variables` after the model was built,
    `optimizer.variables` after `optimizer.build(model.trainable_variables)`.

    Args:
        variables: a variable, or a list (or nested structure) of variables.
        root: the rank whose values every rank gets.

    Raises:
        TypeError: an element of `variables` is no tf.Variable or keras.Variable.
        ValueError: `root` is no rank, or the ranks passed different variables.
        tarantella.CollectiveError: the ranks could not complete the collective.
    """
    variables = tf.nest.flatten(variables)
    for variable in variables:
        if not isinstance(variable, (tf.Variable, keras.Variable)):
            raise TypeError(f"tnt.broadcast_variables takes tf.Variable or keras.Variable objects; got "
                            f"{type(variable).__name__}. To broadcast values, use tnt.broadcast.")
    values = broadcast(variables, root=root)
    for variable, value in zip(variables, values):
        variable.assign(value)


# -- the original Tarantella's classes ------------------------------------------------------
# They return what the original's did: a NumPy scalar for a number (the functions above return a
# 0-d array), the empty list or dict for an empty one, and, from TensorAllgatherer, flattened values.


class TensorAllreducer:
    """Allreduces values shaped like `inputs` (a tensor, array, number, or a list/dict of them).

    Args:
        inputs: values of the shapes and dtypes that `allreduce` will take (no None entries).
        reduction_op: how the values are combined, as `op` of `tnt.allreduce`.

    Raises:
        ValueError: `inputs` holds None, or `reduction_op` is unknown.
        TypeError: a value is neither a tensor, variable, array nor number.
    """

    def __init__(self, inputs: Values, reduction_op: ReductionOp | str = ReductionOp.SUM) -> None:
        self._template = calls.checked_template("TensorAllreducer", inputs)
        self._op = _reduction_op(reduction_op)

    def allreduce(self, inputs: Values) -> Values:
        """Combines `inputs` over all ranks, as `tnt.allreduce` does.

        Args:
            inputs: values structured, shaped and typed as the constructor's `inputs`.

        Returns:
            The combined values; a number given eagerly comes back as a NumPy scalar.

        Raises:
            ValueError: `inputs` differ from the constructor's in structure, shape or dtype.
        """
        calls.check_like_template("TensorAllreducer.allreduce", self._template, inputs)
        return calls.numbers_for_numbers(inputs, allreduce(inputs, self._op))


class TensorBroadcaster:
    """Broadcasts values shaped like `inputs` from `root_rank`.

    `broadcast(inputs)` on the root sends its values; other ranks may call `broadcast()`
    without inputs and receive values shaped like the constructor's `inputs`.

    Args:
        inputs: values of the shapes and dtypes that `broadcast` will move (no None entries).
        root_rank: the rank that sends.

    Raises:
        ValueError: `inputs` holds None, or `root_rank` is no rank.
        TypeError: a value is neither a tensor, variable, array nor number.
    """

    def __init__(self, inputs: Values, root_rank: int = world.MASTER_RANK) -> None:
        self._template = calls.checked_template("TensorBroadcaster", inputs)
        self._root = calls.check_root(root_rank)

    def broadcast(self, inputs: Values | None = None) -> Values:
        """Every rank gets the root's `inputs`, as from `tnt.broadcast`.

        Args:
            inputs: the values to send on the root; on the other ranks, values like them, or
                None to receive values shaped like the constructor's `inputs`.

        Returns:
            The root's values; a number given eagerly comes back as a NumPy scalar.

        Raises:
            ValueError: the root passed no `inputs`, or `inputs` differ from the constructor's
                in structure, shape or dtype.
        """
        if inputs is None:
            if world.get_rank() == self._root:
                raise ValueError("TensorBroadcaster.broadcast() needs the values to send on the root rank "
                                 f"({self._root}). Pass them: broadcaster.broadcast(values).")
            inputs = self._template
        calls.check_like_template("TensorBroadcaster.broadcast", self._template, inputs)
        return calls.numbers_for_numbers(inputs, broadcast(inputs, self._root))


class TensorAllgatherer:
    """Gathers values shaped like `inputs` (the first axis may vary) from every rank: each value
    becomes the 1-D concatenation, in rank order, of every rank's value flattened.

    Args:
        inputs: values of the dtypes, and the shapes after the first axis, that `allgather` will
            take (no None entries).

    Raises:
        ValueError: `inputs` holds None.
        TypeError: a value is neither a tensor, variable, array nor number.
    """

    def __init__(self, inputs: Values) -> None:
        self._template = calls.checked_template("TensorAllgatherer", inputs)

    def allgather(self, inputs: Values) -> Values:
        """Gathers `inputs` from every rank, as `tnt.allgather` does, and flattens each result.

        Args:
            inputs: values structured and typed as the constructor's `inputs`; the first axis may
                differ from rank to rank.

        Returns:
            One 1-D value per value of `inputs`, the concatenation of every rank's value flattened,
            in rank order.

        Raises:
            ValueError: `inputs` differ from the constructor's in structure, dtype or shape after
                the first axis.
        """
        calls.check_like_template("TensorAllgatherer.allgather", self._template, inputs, first_axis_may_vary=True)
        return tf.nest.map_structure(calls.flattened, allgather(inputs))


def _reduction_op(op):
    try:
        return ReductionOp(op)
    except ValueError:
        raise ValueError(f"Unknown reduction {op!r}: use one of "
                         f"{', '.join(repr(o.value) for o in ReductionOp)} (or tnt.ReductionOp).") from None
