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

from tarantella import backends
from tarantella.backends import fusion
from tarantella.runtime import world
from tarantella.runtime.kinds import Collective

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


_REDUCIBLE = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64,
              tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.complex64, tf.complex128}
_MOVABLE = _REDUCIBLE | {tf.bool}
_ORDERED = _REDUCIBLE - {tf.complex64, tf.complex128}


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
    leaves = _leaves("allreduce", values)
    for leaf in leaves:
        if leaf is not None:
            _check_reducible(leaf.dtype, op)
    return _collective("allreduce", values, leaves, lambda comm, arrays, _: _allreduce(comm, arrays, op),
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
    root = _check_root(root)
    leaves = _leaves("broadcast", values)
    for leaf in leaves:
        if leaf is not None:
            _check_movable("broadcast", leaf.dtype)
    return _collective("broadcast", values, leaves, lambda comm, arrays, _: _broadcast(comm, arrays, root),
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
    leaves = _leaves("allgather", values)
    for leaf in leaves:
        if leaf is not None:
            _check_movable("allgather", leaf.dtype)
    return _collective("allgather", values, leaves, _allgather, _gathered_shape, detail=None,
                       rows_may_differ=True)


def _gathered_shape(shape):
    if shape.rank is None:
        return shape
    return tf.TensorShape([None]).concatenate(shape[1:])


@tf.autograph.experimental.do_not_convert
def barrier() -> None:
    """Returns once every rank has called it.

    Raises:
        tarantella.CollectiveError: the ranks could not complete the collective (e.g. a rank did not
            call it in time).
    """
    _collective("barrier", [], [], lambda comm, arrays, _: [], lambda shape: shape, detail=None)


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
        self._template = _checked_template("TensorAllreducer", inputs)
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
        _check_like_template("TensorAllreducer.allreduce", self._template, inputs)
        return _numbers_for_numbers(inputs, allreduce(inputs, self._op))


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
        self._template = _checked_template("TensorBroadcaster", inputs)
        self._root = _check_root(root_rank)

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
        _check_like_template("TensorBroadcaster.broadcast", self._template, inputs)
        return _numbers_for_numbers(inputs, broadcast(inputs, self._root))


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
        self._template = _checked_template("TensorAllgatherer", inputs)

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
        _check_like_template("TensorAllgatherer.allgather", self._template, inputs, first_axis_may_vary=True)
        return tf.nest.map_structure(_flattened, allgather(inputs))


def _flattened(value):
    return value.reshape(-1) if isinstance(value, np.ndarray) else tf.reshape(value, [-1])


def _numbers_for_numbers(inputs, results):
    """A Python or NumPy number given eagerly comes back as a NumPy scalar of its dtype."""
    def unwrap(given, result):
        is_number = isinstance(given, (int, float, complex, np.generic))
        return result[()] if is_number and isinstance(result, np.ndarray) else result
    return tf.nest.map_structure(unwrap, inputs, results)


# -- calls: eager or inside a tf.function -------------------------------------------------------


def _collective(name, values, leaves, operation, output_shape, detail, rows_may_differ=False):
    """Runs `operation(mpi_comm, arrays, layouts)` on the worker once all ranks are seen to agree."""
    comm = world.init()
    present = [i for i, leaf in enumerate(leaves) if leaf is not None]

    def job(*arrays):
        arrays = [np.asarray(a, order="C") for a in arrays]  # ascontiguousarray would make scalars 1-D
        layout = (name, detail, [(i, str(a.dtype), a.shape) for i, a in zip(present, arrays)])

        def run(mpi_comm):
            if rows_may_differ or not comm.compared_alike:
                layouts = mpi_comm.allgather(layout)
                _check_same_layout(name, layouts, rows_may_differ)
            else:
                layouts = None  # only allgather reads them
            return operation(mpi_comm, arrays, layouts)

        # The ranks agree on "a public collective"; the opening's message also compares the calls'
        # layouts, and only where they differ are they gathered: _check_same_layout's error names
        # them and leaves the ranks able to go on.
        return comm.run(f"tnt.{name}", run, kind=Collective.PUBLIC,
                        agree_on="a public collective (tnt.allreduce, ...)",
                        compare=None if rows_may_differ else repr(layout))

    if tf.executing_eagerly():
        results = job(*[leaves[i] if isinstance(leaves[i], np.ndarray) else leaves[i].value.numpy()
                        for i in present])
        # NumPy in, NumPy out; tensors and variables in, tensors out.
        outputs = {i: result if isinstance(leaves[i], np.ndarray) else
                   tf.convert_to_tensor(result, leaves[i].dtype) for i, result in zip(present, results)}
    else:
        tensors = [tf.convert_to_tensor(leaves[i] if isinstance(leaves[i], np.ndarray) else leaves[i].value)
                   for i in present]
        results = tf.numpy_function(job, tensors, [t.dtype for t in tensors], stateful=True, name=f"tnt_{name}")
        outputs = {}
        for i, tensor, result in zip(present, tensors, results if present else []):
            result.set_shape(output_shape(tensor.shape))
            outputs[i] = result
    return tf.nest.pack_sequence_as(values, [outputs.get(i) for i in range(len(leaves))])


def _leaves(name, values):
    leaves = tf.nest.flatten(values)
    converted = []
    step = backends.step_class()
    for leaf in leaves:
        leaf = step.collective_leaf(name, leaf)
        if type(leaf).__module__.startswith("jax"):  # a JAX array where another backend runs
            leaf = np.asarray(leaf)
        if leaf is None or isinstance(leaf, (tf.Tensor, tf.Variable, keras.Variable)):
            converted.append(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic, int, float, complex, bool)):
            converted.append(np.asarray(leaf))
        else:
            raise TypeError(f"tnt.{name} takes tensors, variables, NumPy arrays and numbers, or lists, "
                            f"tuples and dicts of them; got {type(leaf).__name__}.")
    return [leaf if leaf is None or isinstance(leaf, np.ndarray) else _DTypeOf(leaf) for leaf in converted]


class _DTypeOf:
    """A tensor or variable with its TensorFlow dtype at hand (NumPy arrays carry their own)."""

    def __init__(self, value):
        self.value = value.value if isinstance(value, keras.Variable) else value
        self.dtype = tf.as_dtype(self.value.dtype)
        self.shape = self.value.shape


def _check_same_layout(name, layouts, rows_may_differ):
    """Raises the same error on every rank (all see the same layouts) if the ranks disagree."""
    first = layouts[0]
    for rank, theirs in enumerate(layouts[1:], start=1):
        if theirs[:2] != first[:2]:
            raise ValueError(
                f"tnt.{name}: the ranks called different collectives or arguments: rank 0 called "
                f"{_describe_call(first)}, rank {rank} called {_describe_call(theirs)}. Every rank must make "
                "the same collective calls, in the same order, with the same arguments.")
        if [i for i, _, _ in theirs[2]] != [i for i, _, _ in first[2]]:
            raise ValueError(
                f"tnt.{name}: rank {rank} passed {len(theirs[2])} values, rank 0 {len(first[2])} (or None in "
                "different places). Every rank must pass the same structure.")
        for (index, dtype_a, shape_a), (_, dtype_b, shape_b) in zip(first[2], theirs[2]):
            if rows_may_differ:
                same = dtype_a == dtype_b and shape_a[1:] == shape_b[1:] and len(shape_a) == len(shape_b)
                rule = "the same dtype and the same shape after the first axis"
            else:
                same = dtype_a == dtype_b and shape_a == shape_b
                rule = "the same dtype and shape"
            if not same:
                raise ValueError(
                    f"tnt.{name}: value #{index} is {dtype_a} of shape {shape_a} on rank 0 but {dtype_b} of "
                    f"shape {shape_b} on rank {rank}. Every rank must pass {rule}.")


def _describe_call(layout):
    name, detail, _ = layout
    return f"tnt.{name}" + ("" if detail is None else f"({detail!r})")


# -- the operations, on the worker thread -------------------------------------------------


def _allreduce(mpi_comm, arrays, op):
    MPI = world.mpi()
    mpi_op = {ReductionOp.SUM: MPI.SUM, ReductionOp.AVERAGE: MPI.SUM, ReductionOp.PRODUCT: MPI.PROD,
              ReductionOp.MIN: MPI.MIN, ReductionOp.MAX: MPI.MAX}[op]
    results = []
    for array in arrays:
        # MPI has no portable 16-bit float (backends.fusion): such values are reduced in float32 and cast back.
        wire = array.astype(fusion.wire_dtype(tf.as_dtype(array.dtype).name))
        mpi_comm.Allreduce(MPI.IN_PLACE, wire, op=mpi_op)
        if op is ReductionOp.AVERAGE:
            wire /= mpi_comm.Get_size()
        results.append(wire.astype(array.dtype, copy=False))
    return results


def _broadcast(mpi_comm, arrays, root):
    """All values in one message: the root's bytes overwrite everyone's."""
    if not arrays:
        return []
    buffer = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    mpi_comm.Bcast(buffer, root=root)
    results, start = [], 0
    for array in arrays:
        results.append(buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape))
        start += array.nbytes
    return results


def _allgather(mpi_comm, arrays, layouts):
    results = []
    for position, array in enumerate(arrays):
        rows = array if array.ndim else array.reshape(1)  # a scalar is one row
        counts = [shape[0] if shape else 1 for _, _, shape in (layout[2][position] for layout in layouts)]
        row_bytes = rows.dtype.itemsize * int(np.prod(rows.shape[1:], dtype=np.int64))
        gathered = np.empty((sum(counts),) + rows.shape[1:], rows.dtype)
        mpi_comm.Allgatherv(rows.reshape(-1).view(np.uint8),
                            [gathered.reshape(-1).view(np.uint8), [n * row_bytes for n in counts]])
        results.append(gathered)
    return results


# -- argument checks (on every rank, before anything is sent) ----------------------------------


def _reduction_op(op):
    try:
        return ReductionOp(op)
    except ValueError:
        raise ValueError(f"Unknown reduction {op!r}: use one of "
                         f"{', '.join(repr(o.value) for o in ReductionOp)} (or tnt.ReductionOp).") from None


def _check_root(root):
    size = world.get_size()
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root={root!r} is not a rank: with {size} rank(s) the root is an int from 0 to "
                         f"{size - 1}.")
    return int(root)


def _check_movable(name, dtype):
    """Returns the TensorFlow dtype of values a collective can move, else raises."""
    try:
        tf_dtype = tf.as_dtype(dtype)
    except TypeError:
        tf_dtype = None
    if tf_dtype not in _MOVABLE:
        raise TypeError(f"tnt.{name} does not support dtype {getattr(tf_dtype, 'name', dtype)}: it moves numbers "
                        "and booleans. Convert strings and other objects to numeric tensors first.")
    return tf_dtype


def _check_reducible(dtype, op):
    dtype = _check_movable("allreduce", dtype)
    if dtype == tf.bool:
        raise TypeError("tnt.allreduce does not reduce booleans: cast them to int32 first (then sum counts "
                        "the True values, max is 'any', min is 'all').")
    if op is ReductionOp.AVERAGE and not (dtype.is_floating or dtype.is_complex):
        raise TypeError(f"tnt.allreduce(op='mean') of {dtype.name} would not keep the dtype: cast to a float "
                        "dtype first, or use op='sum'.")
    if op in (ReductionOp.MIN, ReductionOp.MAX) and dtype not in _ORDERED:
        raise TypeError(f"tnt.allreduce(op={op.value!r}) needs ordered values; {dtype.name} has no order.")


def _checked_template(name, inputs):
    if any(leaf is None for leaf in _leaves(name, inputs)):
        raise ValueError(f"tnt.{name} needs values to work on: replace the None entries with values of the "
                         "shapes and dtypes you will pass.")
    return inputs


def _check_like_template(name, template, inputs, first_axis_may_vary=False):
    try:
        tf.nest.assert_same_structure(template, inputs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: the inputs are structured differently from the constructor's: {error}")
    for expected, given in zip(_leaves(name, template), _leaves(name, inputs)):
        shape_a, shape_b = tf.TensorShape(expected.shape), tf.TensorShape(given.shape)
        if first_axis_may_vary and shape_a.rank and shape_b.rank:
            shape_a, shape_b = shape_a[1:], shape_b[1:]
        if tf.as_dtype(expected.dtype) != tf.as_dtype(given.dtype) or not shape_a.is_compatible_with(shape_b):
            raise ValueError(f"{name}: got {tf.as_dtype(given.dtype).name} of shape {given.shape}, but the "
                             f"constructor's inputs hold {tf.as_dtype(expected.dtype).name} of shape "
                             f"{expected.shape} here. Make a new object for other shapes.")
