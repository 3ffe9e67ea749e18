"""How a public collective (`tarantella.collectives`) runs: its values flattened and checked, one job
on the worker that first finds whether every rank passed the same layout (and names the difference
where not), the MPI operation on NumPy arrays, and the results given back in the caller's structure,
eagerly or from a stateful `tf.numpy_function` inside a tf.function."""

import keras
import numpy as np
import tensorflow as tf

from tarantella import backends
from tarantella.backends import fusion
from tarantella.runtime import world
from tarantella.runtime.kinds import Collective


_REDUCIBLE = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int16, tf.int32, tf.int64,
              tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.complex64, tf.complex128}


_MOVABLE = _REDUCIBLE | {tf.bool}


_ORDERED = _REDUCIBLE - {tf.complex64, tf.complex128}


def collective(name, values, leaves, operation, output_shape, detail, rows_may_differ=False):
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


def leaves_of(name, values):
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


def flattened(value):
    return value.reshape(-1) if isinstance(value, np.ndarray) else tf.reshape(value, [-1])


def numbers_for_numbers(inputs, results):
    """A Python or NumPy number given eagerly comes back as a NumPy scalar of its dtype."""
    def unwrap(given, result):
        is_number = isinstance(given, (int, float, complex, np.generic))
        return result[()] if is_number and isinstance(result, np.ndarray) else result
    return tf.nest.map_structure(unwrap, inputs, results)


def gathered_shape(shape):
    if shape.rank is None:
        return shape
    return tf.TensorShape([None]).concatenate(shape[1:])


def allreduce_arrays(mpi_comm, arrays, op):
    MPI = world.mpi()
    # `op`: a ReductionOp, a str enum: equal to its value.
    mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[op]
    results = []
    for array in arrays:
        # MPI has no portable 16-bit float (backends.fusion): such values are reduced in float32 and cast back.
        wire = array.astype(fusion.wire_dtype(tf.as_dtype(array.dtype).name))
        mpi_comm.Allreduce(MPI.IN_PLACE, wire, op=mpi_op)
        if op == "mean":
            wire /= mpi_comm.Get_size()
        results.append(wire.astype(array.dtype, copy=False))
    return results


def broadcast_arrays(mpi_comm, arrays, root):
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


def allgather_arrays(mpi_comm, arrays, layouts):
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


def check_root(root):
    size = world.get_size()
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root={root!r} is not a rank: with {size} rank(s) the root is an int from 0 to "
                         f"{size - 1}.")
    return int(root)


def check_movable(name, dtype):
    """Returns the TensorFlow dtype of values a collective can move, else raises."""
    try:
        tf_dtype = tf.as_dtype(dtype)
    except TypeError:
        tf_dtype = None
    if tf_dtype not in _MOVABLE:
        raise TypeError(f"tnt.{name} does not support dtype {getattr(tf_dtype, 'name', dtype)}: it moves numbers "
                        "and booleans. Convert strings and other objects to numeric tensors first.")
    return tf_dtype


def check_reducible(dtype, op):
    dtype = check_movable("allreduce", dtype)
    if dtype == tf.bool:
        raise TypeError("tnt.allreduce does not reduce booleans: cast them to int32 first (then sum counts "
                        "the True values, max is 'any', min is 'all').")
    if op == "mean" and not (dtype.is_floating or dtype.is_complex):
        raise TypeError(f"tnt.allreduce(op='mean') of {dtype.name} would not keep the dtype: cast to a float "
                        "dtype first, or use op='sum'.")
    if op in ("min", "max") and dtype not in _ORDERED:
        raise TypeError(f"tnt.allreduce(op={op.value!r}) needs ordered values; {dtype.name} has no order.")


def checked_template(name, inputs):
    if any(leaf is None for leaf in leaves_of(name, inputs)):
        raise ValueError(f"tnt.{name} needs values to work on: replace the None entries with values of the "
                         "shapes and dtypes you will pass.")
    return inputs


def check_like_template(name, template, inputs, first_axis_may_vary=False):
    try:
        tf.nest.assert_same_structure(template, inputs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: the inputs are structured differently from the constructor's: {error}")
    for expected, given in zip(leaves_of(name, template), leaves_of(name, inputs)):
        shape_a, shape_b = tf.TensorShape(expected.shape), tf.TensorShape(given.shape)
        if first_axis_may_vary and shape_a.rank and shape_b.rank:
            shape_a, shape_b = shape_a[1:], shape_b[1:]
        if tf.as_dtype(expected.dtype) != tf.as_dtype(given.dtype) or not shape_a.is_compatible_with(shape_b):
            raise ValueError(f"{name}: got {tf.as_dtype(given.dtype).name} of shape {given.shape}, but the "
                             f"constructor's inputs hold {tf.as_dtype(expected.dtype).name} of shape "
                             f"{expected.shape} here. Make a new object for other shapes.")
