"""The emulated cluster's step model: tarantella's own (tarantella/timeline_projection.py, which
`tarantella-timeline --project` runs for users), with the bucket-ready schedule of a profile cut by
tarantella's own fusion plan (tarantella/backends/fusion.py).

Both are loaded from their files: importing them by name would first import the tarantella package,
which starts TensorFlow and MPI in the benchmark's driver.
"""

import importlib.util
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "tarantella"


def _load(relative_path, name):
    spec = importlib.util.spec_from_file_location(name, _PACKAGE / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FUSION = _load("backends/fusion.py", "tarantella_fusion_for_the_step_model")
_MODEL = _load("timeline_projection.py", "tarantella_projection_for_the_step_model")

RING_MIN_BYTES = _MODEL.RING_MIN_BYTES
log2_steps, ring_cost, mpi_cost, bucket_cost = _MODEL.log2_steps, _MODEL.ring_cost, _MODEL.mpi_cost, _MODEL.bucket_cost
finish_time, predicted_step, limit_step = _MODEL.finish_time, _MODEL.predicted_step, _MODEL.limit_step
projection = _MODEL  # the trace reading, the projection and its table


def automatic_threshold_bytes(ranks, nodes, latency_s, bytes_per_s):
    """tarantella's fusion threshold where the user sets none, on a link of that latency and rate."""
    return FUSION.automatic_threshold_bytes(ranks, nodes, latency_s, bytes_per_s)


def plan_buckets(sizes_in_bytes, threshold_bytes):
    """tarantella's fusion plan for tensors of one dtype."""
    return FUSION.plan_buckets(sizes_in_bytes, ["float32"] * len(sizes_in_bytes), threshold_bytes)


def schedule(stages, threshold_bytes, scale=1.0, bytes_per_element=4):
    """(compute_s, [(ready_s, nbytes)]) of a profile's stages, cut by tarantella's fusion plan."""
    return _MODEL.schedule(stages, threshold_bytes, FUSION.plan_buckets, scale, bytes_per_element)
