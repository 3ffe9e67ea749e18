import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


def launcher_command():
    """The installed `tarantella` command, as a user runs it."""
    script = pathlib.Path(sys.executable).with_name("tarantella")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tarantella.launcher"]


def quiet_env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def launch(ranks, script, *args, options=(), env=None, timeout=600):
    """Runs `tarantella -n RANKS [options] -- script args` and returns the finished process."""
    command = launcher_command() + ["-n", str(ranks), *options, "--", str(script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=quiet_env(**(env or {})))


def run_python(script, *args, env=None, timeout=600):
    """Runs a script with plain `python`, no launcher."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=quiet_env(**(env or {})))


def load_npz(path):
    """A worker's saved results as a dict of arrays."""
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def assert_ok(process):
    assert process.returncode == 0, f"exit {process.returncode}\nstdout:\n{process.stdout}\nstderr:\n{process.stderr}"


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")
