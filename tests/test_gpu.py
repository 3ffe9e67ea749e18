"""The GPU path of every backend, on a machine with NVIDIA GPUs; without one every test here is
skipped (docs/guide.md, "GPUs", records the runs on a lent GPU).

Serial Keras on a GPU against ranks that share it (TNT_SHARE_GPUS=true), ranks with a GPU each
(where the machine has several), and more ranks than GPUs, which train on the CPU. TensorFloat-32
is turned off in every run: it rounds float32 products to 10 bits, far beyond the suite's 1e-5."""

import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import WORKERS, assert_ok, assert_ranks_like_serial, launch, quiet_env, run_python
from tarantella.common.hardware import count_gpus

GPUS = count_gpus()
_PROBES = {"tensorflow": "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))",
           "jax": "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))",
           "torch": "import torch; print(torch.cuda.device_count())"}


def _sees_a_gpu(backend):
    if not GPUS or importlib.util.find_spec(backend) is None:
        return False
    probe = subprocess.run([sys.executable, "-c", _PROBES[backend]], capture_output=True, text=True,
                           env=quiet_env(), timeout=300)
    counts = probe.stdout.split()
    return probe.returncode == 0 and bool(counts) and counts[-1] != "0"


BACKENDS = [backend for backend in _PROBES if _sees_a_gpu(backend)]
pytestmark = pytest.mark.skipif(not BACKENDS, reason="no NVIDIA GPU that TensorFlow, JAX or torch can use")
EXACT_FLOAT32 = {"NVIDIA_TF32_OVERRIDE": "0", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
CASES = ["mlp-sgd", "mlp-momentum", "mlp-adam", "mlp-batch71", "wide-mlp-adam"]


def platforms(process, ranks):
    found = dict(re.findall(r"rank (\d+) trains on (gpu|cpu)", process.stdout))
    assert sorted(found) == [str(rank) for rank in range(ranks)], process.stdout[-2000:]
    return set(found.values())


def trains_like_serial(backend, ranks, tmp_path, serial_env, ranks_env):
    serial, distributed = tmp_path / "serial", tmp_path / "ranks"
    serial.mkdir(), distributed.mkdir()
    assert_ok(run_python(WORKERS / "train_cases.py", "--mode", "serial", "--out", serial, "--cases", ",".join(CASES),
                         env=serial_env))
    assert_ok(launch(ranks, WORKERS / "train_cases.py", "--mode", "tnt", "--out", distributed, "--cases",
                     ",".join(CASES), env=ranks_env))
    assert_ranks_like_serial(serial, distributed, CASES, ranks, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_sharing_a_gpu_train_on_it_like_serial_keras_on_it(backend, tmp_path):
    env = {**EXACT_FLOAT32, "KERAS_BACKEND": backend}
    ranks_env = {**env, "TNT_SHARE_GPUS": "true"}
    ranks = GPUS + 1
    process = launch(ranks, WORKERS / "gpu_devices.py", env=ranks_env)
    assert_ok(process)
    assert platforms(process, ranks) == {"gpu"}
    trains_like_serial(backend, ranks, tmp_path, env, ranks_env)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_ranks_than_gpus_train_on_the_cpu_like_serial_keras_there(backend, tmp_path):
    env = {**EXACT_FLOAT32, "KERAS_BACKEND": backend}
    ranks = GPUS + 1
    process = launch(ranks, WORKERS / "gpu_devices.py", env=env)
    assert_ok(process)
    assert platforms(process, ranks) == {"cpu"}
    assert f"{ranks} ranks per node but only {GPUS} GPU(s)" in process.stderr + process.stdout
    on_cpu = {**env, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    trains_like_serial(backend, ranks, tmp_path, on_cpu, env)


@pytest.mark.skipif(GPUS < 2, reason="one GPU: no two ranks can have a GPU each")
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_a_gpu_each_train_like_serial_keras_on_a_gpu(backend, tmp_path):
    env = {**EXACT_FLOAT32, "KERAS_BACKEND": backend}
    process = launch(2, WORKERS / "gpu_devices.py", env=env)
    assert_ok(process)
    assert platforms(process, 2) == {"gpu"}
    trains_like_serial(backend, 2, tmp_path, env, env)
