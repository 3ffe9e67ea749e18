"""Splits every global batch of a tf.data pipeline across the ranks, sample by sample.

Rank r of p takes rows r, r+p, r+2p, ... of each global batch. Micro-batch sizes
therefore differ by at most one, a last incomplete batch splits by the same rule,
and every rank runs the same number of steps (a rank may get an empty micro-batch
when a batch has fewer samples than there are ranks; it then contributes nothing).

All ranks walk the same sample sequence, so shuffles must be seeded alike: a shuffle
without a seed gets a fixed default one (`rebuild.py`). The per-sample `map`s placed directly
before `batch` run, on each rank, only for the samples it owns, and each rank batches only
its own rows: the global batch is never built. Where the samples come from files, each rank
reads only its own records (`file_records.py`).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tarantella.data import file_records
from tarantella.data.notes import info_once
from tarantella.data.rebuild import (BATCHES, FILE_READERS, INTERLEAVES, MAPS, REAPPLY, check_seeds_outside,
                                     draws_random_numbers, node_name, nodes_below, reuse, static_value, with_seeds)
from tarantella.runtime import world

# What the package publishes of this module (as tnt.data.distribute); its other functions serve the package.
__all__ = ["distribute"]

logger = logging.getLogger("tarantella")


def micro_batch_size(global_batch_size, rank, size):
    """Number of rows of a global batch that `rank` processes."""
    return global_batch_size // size + (1 if rank < global_batch_size % size else 0)


def distribute(dataset: tf.data.Dataset, rank: int | None = None, size: int | None = None) -> tf.data.Dataset:
    """Returns the dataset of rank `rank` (default: this process's): its micro-batches, one per global batch.

    Rank r of p gets rows r, r + p, r + 2p, ... of each global batch, as `tnt.Model.fit` does, and
    every rank gets the same number of batches (some may be empty). A shuffle without any seed
    gets a fixed one, so that every rank draws the same order.

    Args:
        dataset: a `tf.data.Dataset` batched with the global batch size.
        rank: the rank to split for (default: this process's); given with `size`.
        size: the number of ranks to split for (default: this job's); given with `rank`.

    Returns:
        tf.data.Dataset: this rank's micro-batches.

    Raises:
        TypeError: `dataset` is not a `tf.data.Dataset`.
        ValueError: the dataset is not batched, or holds a shuffle without a seed that
            tarantella cannot rebuild.
    """
    if rank is None or size is None:
        comm = world.init()
        rank, size = comm.rank, comm.size
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"tarantella distributes tf.data.Dataset inputs; got {type(dataset).__name__}. "
            "Build one with tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).")
    _check_batched(dataset)
    chain = _rebuildable_chain(dataset)
    base = chain[0]._input_dataset if chain else dataset
    check_seeds_outside(base)
    batch_index = _global_batch_index(chain)
    global_batch = _static_batch_size(chain, batch_index)
    if global_batch is not None and global_batch < size:
        logger.warning(
            "The global batch size (%d) is smaller than the number of ranks (%d): ranks %d to %d "
            "get no samples and idle. Use a global batch of at least %d.",
            global_batch, size, global_batch, size - 1, size)
    if size == 1:  # only the shuffle seeds change, so one rank sees what N ranks see together
        return with_seeds(chain, len(chain), dataset)
    why_whole_batch = _why_whole_batches(chain, batch_index)
    if why_whole_batch is None:
        distributed = _own_micro_batches(chain, batch_index, base, rank, size)
        if int(dataset.cardinality()) >= 0:  # one micro-batch per global batch; tells Keras the steps
            distributed = distributed.apply(tf.data.experimental.assert_cardinality(dataset.cardinality()))
    else:
        info_once("tarantella: each rank builds the whole global batch and keeps its rows, because %s.",
                   why_whole_batch)
        distributed = with_seeds(chain, len(chain), dataset).map(
            _rows_of_rank(dataset.element_spec, rank, size))
    if dataset.options().deterministic is False:
        options = tf.data.Options()
        options.deterministic = True
        distributed = distributed.with_options(options)
    distributed._tarantella_global_batch_size = global_batch  # global_batch_size() answers for the rank's dataset
    return distributed


def _check_batched(dataset):
    for spec in tf.nest.flatten(dataset.element_spec):
        if not isinstance(spec, (tf.TensorSpec, tf.RaggedTensorSpec)):
            raise TypeError(f"tarantella cannot split dataset elements of type {type(spec).__name__}; "
                            "convert them to dense or ragged tensors.")
        if spec.shape.rank == 0:
            raise ValueError(
                "The dataset is not batched: its elements are single samples. Batch it with the "
                "global batch size, e.g. dataset.batch(64); tarantella splits each batch across ranks.")


def _rebuildable_chain(dataset):
    """The transformations from the output down to the first one we cannot re-apply, bottom first."""
    chain = []
    node = dataset
    while type(node).__name__ in REAPPLY:
        chain.append(node)
        node = node._input_dataset
    return chain[::-1]


def _global_batch_index(chain):
    for index in reversed(range(len(chain))):
        if type(chain[index]).__name__ in BATCHES:
            return index
    return None


def global_batch_size(dataset):
    """The batch size of the pipeline's last `batch` when it is a constant, else None (for a rank's
    distributed dataset: the global batch it was split from)."""
    if hasattr(dataset, "_tarantella_global_batch_size"):
        return dataset._tarantella_global_batch_size
    chain = _rebuildable_chain(dataset)
    return _static_batch_size(chain, _global_batch_index(chain))


def _static_batch_size(chain, batch_index):
    """The global batch size, if the pipeline's last `batch` has a constant one."""
    if batch_index is None:
        return None
    value = tf.get_static_value(chain[batch_index]._batch_size)
    return None if value is None else int(value)


# What may follow the global batch when each rank batches only its own samples: these keep
# every batch's rows as they are. Anything else (a map, filter, interleave) sees the whole
# global batch in a serial run, so it must see it on every rank too.
_KEEPS_BATCH_ROWS = {"_ShuffleDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset", "_PrefetchDataset",
                     "_OptionsDataset", "CacheDataset"}


def _why_whole_batches(chain, batch_index):
    """Why each rank must build the whole global batch and keep its rows (None: it can batch only its
    own samples, which needs a plain batch of constant size, dense rows, and nothing after it that
    looks at a batch's contents)."""
    if batch_index is None:
        return "the dataset's last batch is missing"
    node = chain[batch_index]
    if type(node).__name__ == "_PaddedBatchDataset":
        return "the dataset's last batch pads its rows"
    if _static_batch_size(chain, batch_index) is None or tf.get_static_value(node._drop_remainder) is None:
        return "the dataset's last batch has no constant size"
    if not all(isinstance(spec, tf.TensorSpec) and spec.shape.rank is not None
               for spec in tf.nest.flatten(node.element_spec)):
        return "the dataset's last batch has rows that are not dense tensors of known rank"
    after = [n for n in chain[batch_index + 1:] if type(n).__name__ not in _KEEPS_BATCH_ROWS]
    if after:
        return (f"a {node_name(after[0])} follows batch() and works on whole global batches, as in a serial "
                "run; put per-sample work before batch() to split it across ranks")
    return None


def _own_micro_batches(chain, batch_index, base, rank, size):
    """The pipeline rebuilt so that the rank maps and batches only its own samples."""
    first_split = batch_index
    while first_split > 0 and type(chain[first_split - 1]).__name__ in MAPS + ("_PrefetchDataset",):
        first_split -= 1
    maps = [node for node in chain[first_split:batch_index] if type(node).__name__ in MAPS]
    if any(draws_random_numbers(node._map_func) for node in maps):
        info_once("tarantella: a map before batch() draws random numbers (or changes a variable); each "
                   "rank runs it only for its own samples, so draws come from per-rank streams and differ "
                   "from a serial run's. For draws that equal serial training, use stateless random ops "
                   "seeded per sample (see 'Random augmentation' in docs/guide.md).")
    per_sample = [reuse(node._map_func) for node in maps]
    parallel = [static_value(node._num_parallel_calls) for node in maps if hasattr(node, "_num_parallel_calls")]
    parallel = tf.data.AUTOTUNE if tf.data.AUTOTUNE in parallel else max(parallel, default=None)
    record_index, read, why_whole = file_records.record_index(chain, first_split, base)
    if record_index is not None:  # each rank reads only its own records' bytes, in a map of its own
        samples = record_index
        per_sample.insert(0, read)
        parallel = parallel or tf.data.AUTOTUNE
    else:
        _explain_work_on_every_rank(chain, first_split, base, why_whole)
        if not per_sample and _sample_bytes(chain[batch_index]) <= _SLICE_WHOLE_BATCH_MAX_SAMPLE_BYTES:
            # Nothing per sample to split: selecting the rank's samples one by one would cost
            # more than batching the global batch and slicing the rank's rows out of it.
            return with_seeds(chain, len(chain), base).map(_rows_of_rank(chain[-1].element_spec, rank, size))
        samples = with_seeds(chain, first_split, base)
    micro_batches = _micro_batches_of_rank(samples, per_sample, parallel, chain[batch_index], rank, size)
    for node in chain[batch_index + 1:]:
        micro_batches = REAPPLY[type(node).__name__](node, micro_batches)
    return micro_batches


# Up to this sample size, a rank with no per-sample work to split batches the whole global batch
# and slices its rows out: selecting its samples one by one costs a few tf.data ops per sample,
# about as much as copying this many bytes (LeNet-5 on 2 ranks: 8.1 against 5.9 ms a step).
_SLICE_WHOLE_BATCH_MAX_SAMPLE_BYTES = 64 << 10


def _sample_bytes(batch_node):
    """Bytes of one sample of the batch's input, or infinity where a shape is not static."""
    total = 0
    for spec in tf.nest.flatten(batch_node._input_dataset.element_spec):
        if not spec.shape.is_fully_defined():
            return float("inf")
        total += spec.shape.num_elements() * spec.dtype.size
    return total


def _micro_batches_of_rank(samples, per_sample, parallel, batch_node, rank, size):
    """Per global batch, the rank's samples mapped (`per_sample` functions) and batched: exactly one
    micro-batch each.

    The rank keeps, besides its own samples, one marker row per global batch (its first row;
    its last with drop_remainder) that it never maps: a global batch in which the rank owns
    nothing still yields an empty micro-batch, and an incomplete one is dropped as serially."""
    batch_size = int(tf.get_static_value(batch_node._batch_size))
    drop_remainder = bool(tf.get_static_value(batch_node._drop_remainder))
    rows = micro_batch_size(batch_size, rank, size)
    marker = batch_size - 1 if drop_remainder else 0
    kept_per_batch = rows + (0 if marker % size == rank else 1)

    def owned(position, _=None):
        return tf.equal(position % batch_size % size, rank)

    def kept(position, _):
        return tf.logical_or(owned(position), tf.equal(position % batch_size, marker))

    def run(element):
        for function in per_sample:
            element = function(*element) if isinstance(element, tuple) else function(element)
        return element

    kept_samples = samples.enumerate().filter(kept)
    sample_spec = batch_node._input_dataset.element_spec
    if per_sample and not all(spec.shape.is_fully_defined() for spec in tf.nest.flatten(sample_spec)):
        return _micro_batches_in_windows(kept_samples, run, parallel, batch_node, rows, kept_per_batch,
                                         owned, marker)

    @tf.autograph.experimental.do_not_convert
    def mapped_if_owned(position, sample):
        # the marker row becomes zeros of the right shape; the rank drops it after batching
        placeholder = lambda: tf.nest.map_structure(lambda spec: tf.zeros(spec.shape, spec.dtype), sample_spec)
        return position, tf.cond(owned(position), lambda: run(sample), placeholder) if per_sample else sample

    @tf.autograph.experimental.do_not_convert
    def own_rows(positions, batch):
        mine = owned(positions)
        return tf.nest.map_structure(lambda rows_: tf.boolean_mask(rows_, mine), batch)

    batches = kept_samples.map(mapped_if_owned, num_parallel_calls=parallel,
                               deterministic=True if parallel else None).batch(kept_per_batch)
    if drop_remainder:  # a complete global batch has its last row, the marker
        batches = batches.filter(lambda positions, _: tf.reduce_any(tf.equal(positions % batch_size, marker)))
    return batches.map(own_rows)


def _micro_batches_in_windows(kept_samples, run, parallel, batch_node, rows, kept_per_batch, owned, marker):
    """As _micro_batches_of_rank, for samples of shapes not known in advance (no placeholder row can
    stand for the marker): each global batch's rows are mapped and batched in a window of their own."""
    batch_size = int(tf.get_static_value(batch_node._batch_size))
    no_rows = tf.nest.map_structure(_no_rows, batch_node.element_spec)

    def micro_batch(_, window):
        batch = window.filter(owned).map(lambda _, sample: run(sample), num_parallel_calls=parallel,
                                         deterministic=True if parallel else None)
        batch = batch.batch(max(rows, 1)).concatenate(tf.data.Dataset.from_tensors(no_rows)).take(1)
        if tf.get_static_value(batch_node._drop_remainder):  # a complete global batch has its last row
            complete = window.reduce(False, lambda seen, element: tf.logical_or(
                seen, tf.equal(element[0] % batch_size, marker)))
            batch = batch.take(tf.cast(complete, tf.int64))
        return batch

    return kept_samples.group_by_window(lambda position, _: position // batch_size, micro_batch,
                                        window_size=kept_per_batch)


def _no_rows(spec):
    """An empty micro-batch; a dimension the spec leaves open gets size 0."""
    return tf.zeros([0] + [0 if d is None else d for d in spec.shape.as_list()[1:]], spec.dtype)


def _explain_work_on_every_rank(chain, first_split, base, why_whole):
    """One INFO line for per-sample work that every rank does for every sample."""
    unsplit_maps = [i for i in range(first_split) if type(chain[i]).__name__ in MAPS]
    if unsplit_maps:
        blocker = chain[unsplit_maps[-1] + 1]
        info_once("tarantella: a map runs on every rank for every sample, because the %s after it, before "
                   "batch(), needs every sample to keep the serial order. Put it before the map to split "
                   "the map across ranks.", node_name(blocker))
    if why_whole is None:
        readers = [node for node in nodes_below(base) if type(node).__name__ in FILE_READERS + INTERLEAVES]
        why_whole = f"the {node_name(readers[0])} below a transformation tarantella cannot rebuild" if readers else None
    if why_whole:
        info_once("tarantella: every rank reads every record, to keep the serial sample order, because of %s. "
                   "To read about 1/p of the bytes per rank, see 'File sources' in docs/guide.md.", why_whole)


def rows_of_rank(batch, rank, size):
    """Rows rank, rank + size, ... of a batch: a TensorFlow tensor (dense or ragged), or an array of
    NumPy, JAX or torch (None stays None)."""
    if batch is None:
        return None
    if not isinstance(batch, (tf.Tensor, tf.RaggedTensor, tf.Variable)):
        return batch[rank::size]
    # A gather, not batch[rank::size]: TensorFlow's CPU kernel for a strided slice copies element
    # by element (LeNet-5's 64 of 128 rows: 300 us against 80 us).
    count = batch.nrows() if isinstance(batch, tf.RaggedTensor) else tf.shape(batch, out_type=tf.int64)[0]
    return tf.gather(batch, tf.range(tf.minimum(tf.cast(rank, count.dtype), count), count, size))  # none past the end


def _rows_of_rank(element_spec, rank, size):
    @tf.autograph.experimental.do_not_convert
    def rows(*args):
        element = args if isinstance(element_spec, tuple) else args[0]
        return tf.nest.map_structure(lambda batch: rows_of_rank(batch, rank, size), element)

    return rows
