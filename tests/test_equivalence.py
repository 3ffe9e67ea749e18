"""N ranks train to the weights, logs, evaluation and predictions of serial Keras, with and without XLA.

Tolerances: weights atol 1e-5 (a thread-count change alone moves them by ~1e-7);
History and evaluate values rtol 1e-5. Every rank must end with bitwise-identical weights.
LeNet-5 trains with momentum SGD: with Adam, serial Keras itself moves by 3e-4 between
1 and 2 threads (Adam scales rounding noise on near-zero gradients up to full steps).
"""

import importlib.util
import os
import re

import numpy as np
import pytest

from conftest import (WORKERS, assert_accumulation_sums_once_per_cycle, assert_ok, assert_ranks_like_serial, launch,
                      load_npz, run_python)
from workers.train_cases import CASES

WORKER = WORKERS / "train_cases.py"
# Two ranks run every case. Three ranks (uneven micro-batches on 2 cores, the slowest runs of
# the suite) run the cases whose split depends on the rank count: uneven and tiny batches, a
# nested input, several steps per execution. One rank is tnt.Model on a single process, which
# every example's serial run in tests/test_*example*.py exercises.
# Gradient accumulation's 1/1/0 split on 3 ranks runs in tests/test_torch_backend.py by default,
# and on every backend with TNT_BACKEND_TESTS=1.
UNEVEN_SPLIT_CASES = ["mlp-batch71", "mlp-batch2", "dict-momentum", "mlp-steps-per-execution"]
CASES_BY_RANKS = {2: list(CASES), 3: UNEVEN_SPLIT_CASES}


@pytest.fixture(scope="module")
def serial_dir(scratch):
    out = scratch / "serial"
    out.mkdir()
    assert_ok(run_python(WORKER, "--mode", "serial", "--out", out))
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_like_serial_keras(ranks, serial_dir, scratch):
    out = scratch / f"ranks{ranks}"
    out.mkdir()
    cases = CASES_BY_RANKS[ranks]
    assert_ok(launch(ranks, WORKER, "--mode", "tnt", "--out", out, "--cases", ",".join(cases)))
    assert_ranks_like_serial(serial_dir, out, cases, ranks)
    if "mlp-accumulation" in cases:
        assert_accumulation_sums_once_per_cycle(serial_dir, out, ranks)


# XLA (compile(jit_compile=True), serially too). The default run: a convnet on 2 ranks, and where
# TensorFlow put XLA's clusters. TNT_XLA_TESTS=1: every case on 1 and 2 ranks (gradient
# accumulation included) and the uneven splits on 3.
XLA_TESTS = os.environ.get("TNT_XLA_TESTS") == "1"
XLA_SLICE = ["lenet5-momentum"]


def xla_cases(ranks):
    return (CASES_BY_RANKS.get(ranks, list(CASES)) if XLA_TESTS else XLA_SLICE)


@pytest.fixture(scope="module")
def serial_xla_dir(scratch):
    out = scratch / "serial-xla"
    out.mkdir()
    cases = list(CASES) if XLA_TESTS else XLA_SLICE
    assert_ok(run_python(WORKER, "--mode", "serial", "--out", out, "--cases", ",".join(cases), "--jit-compile"))
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_ranks_train_like_serial_keras_with_xla(ranks, serial_xla_dir, scratch):
    """On several ranks XLA compiles what lies between the step's collectives: the gradients, the
    update. TensorFlow's clustering dump shows which ops it compiled on each rank: the model's
    matrix products and convolutions, forward and backward, but none of the host calls."""
    if ranks != 2 and not XLA_TESTS:
        pytest.skip("runs with TNT_XLA_TESTS=1")
    out, dumps = scratch / f"xla-ranks{ranks}", scratch / f"xla-graphs{ranks}"
    out.mkdir()
    cases = xla_cases(ranks)
    arguments = ("--mode", "tnt", "--out", out, "--cases", ",".join(cases), "--jit-compile")
    env = {"TF_XLA_FLAGS": "--tf_xla_clustering_debug", "TF_DUMP_GRAPH_PREFIX": str(dumps)}
    assert_ok(launch(ranks, WORKER, *arguments, env=env) if ranks > 1 else run_python(WORKER, *arguments))
    assert_ranks_like_serial(serial_xla_dir, out, cases, ranks)
    if "mlp-accumulation" in cases:
        assert_accumulation_sums_once_per_cycle(serial_xla_dir, out, ranks)
    compiled = {"MatMul", *(["Conv2D", "Conv2DBackpropFilter"] if "lenet5-momentum" in cases else [])}
    for rank in range(ranks if ranks > 1 else 0):
        clustered, host_calls = xla_clustering(dumps / f"rank{rank}")
        assert compiled <= clustered, (rank, sorted(clustered))
        assert host_calls and not host_calls & clustered, (rank, host_calls)


def xla_clustering(folder):
    """(op types that XLA clusters took, op types of host calls) in a rank's dumps of TensorFlow's
    mark_for_compilation pass."""
    clustered, host_calls = set(), set()
    for dump in folder.glob("mark_for_compilation_*.pbtxt"):
        for node in dump.read_text().split("\nnode {")[1:]:
            op = re.search(r'\n  op: "([^"]+)"', node)[1]
            if '"_XlaCluster"' in node:
                clustered.add(op)
            if "PyFunc" in op:
                host_calls.add(op)
    return clustered, host_calls


BACKEND_TESTS = pytest.mark.skipif(os.environ.get("TNT_BACKEND_TESTS") != "1",
                                   reason="runs on every backend with TNT_BACKEND_TESTS=1")


@BACKEND_TESTS
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_gradient_accumulation_on_one_rank_is_serial_keras(backend, tmp_path):
    """Two and three ranks run mlp-accumulation in the matrices of tests/test_equivalence.py,
    tests/test_jax_backend.py and tests/test_torch_backend.py."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    serial, out, env = tmp_path / "serial", tmp_path / "rank", {"KERAS_BACKEND": backend}
    serial.mkdir()
    out.mkdir()
    assert_ok(run_python(WORKER, "--mode", "serial", "--out", serial, "--cases", "mlp-accumulation", env=env))
    assert_ok(run_python(WORKER, "--mode", "tnt", "--out", out, "--cases", "mlp-accumulation", env=env))
    assert_ranks_like_serial(serial, out, ["mlp-accumulation"], 1, backend)
    assert_accumulation_sums_once_per_cycle(serial, out, 1)


@BACKEND_TESTS
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_saves_inside_an_accumulation_cycle_write_serial_keras_accumulators(backend, tmp_path):
    """Inside a cycle each rank's accumulators hold its own part. A ModelCheckpoint every 5 batches
    and at the epoch's end, a BackupAndRestore every 7 batches (the master alone), save_weights on
    every rank with tnt_save_all_devices=True after train_on_batch, and a save that a load and a
    fit go on from: each file holds serial Keras' accumulators, and the fit ends as serial Keras'."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    worker, env, ranks = WORKERS / "accumulation_save_load.py", {"KERAS_BACKEND": backend}, 3
    serial, out = tmp_path / "serial", tmp_path / "ranks"
    serial.mkdir()
    out.mkdir()
    assert_ok(run_python(worker, "--mode", "serial", "--out", serial, env=env))
    assert_ok(launch(ranks, worker, "--mode", "tnt", "--out", out, env=env))
    assert_ranks_like_serial(serial, out, ["accumulation-save-load"], ranks, backend)
    accumulators = load_npz(serial / "accumulation-save-load.accumulators.npz")
    for key, value in load_npz(out / "accumulation-save-load.accumulators.npz").items():
        np.testing.assert_allclose(value, accumulators[key], rtol=1e-5, atol=1e-6, err_msg=f"{backend}, {key}")
    saved = sorted(path.name for path in serial.glob("*.rank0.npz") if not path.name.startswith("accumulation"))
    assert len(saved) == 5, saved
    expected = [(name, 0) for name in saved] + [(n, r) for n in saved if n.startswith("saved-on-every-rank")
                                                for r in range(1, ranks)]
    for name, rank in expected:
        in_serial = load_npz(serial / name)
        for key, value in load_npz(out / name.replace(".rank0.", f".rank{rank}.")).items():
            np.testing.assert_allclose(value, in_serial[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{backend}, {name} on rank {rank}, {key}")
