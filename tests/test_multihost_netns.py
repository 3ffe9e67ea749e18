"""Several hosts on one machine (tests/netns_hosts.py): each "host" is a network namespace with
its own address and host name, reached through a stand-in for ssh that runs Hydra's proxy there.

The job starts from a hostfile of the hosts' addresses, the ranks talk over TCP, and the
result must equal serial Keras. Needs root and `ip` (CI runs as root); skipped otherwise.
"""

import os
import subprocess
import time

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launcher_command, quiet_env, run_python
from netns_hosts import namespace_hosts, network_namespace_of

HOSTS = 3
CASES = "mlp-adam,wide-mlp-adam"  # the wide MLP's 1 MiB gradients take the ring allreduce


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with namespace_hosts(HOSTS, tmp_path_factory.mktemp("hosts")) as made:
        yield {"hostfile": made.hostfile, "env": {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(made.ssh)}}


def load(path):
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def test_a_job_over_three_namespace_hosts_trains_like_serial_keras(hosts, tmp_path):
    serial, distributed = tmp_path / "serial", tmp_path / "tnt"
    serial.mkdir()
    distributed.mkdir()
    assert_ok(run_python(WORKERS / "train_cases.py", "--mode", "serial", "--out", serial, "--cases", CASES))
    started = time.monotonic()
    process = subprocess.run(
        launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--no-gpu", "-x", "GREETING=from the launcher", "--",
                              str(WORKERS / "multihost.py"), str(distributed), CASES],
        capture_output=True, text=True, timeout=300, env=quiet_env(**hosts["env"]))
    elapsed = time.monotonic() - started
    assert_ok(process)
    assert elapsed < 120, f"the job took {elapsed:.0f} s"
    namespaces = set()
    for rank in range(HOSTS):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        # MPI sees one rank per node (no shared memory), and the -x variable arrived
        assert line.endswith(" GREETING=from the launcher node ranks 1"), line
        namespaces.add(line.split()[2])
    own = network_namespace_of()
    assert len(namespaces) == HOSTS and own not in namespaces, "each rank runs in its own host's namespace"
    for case in CASES.split(","):
        expected = load(serial / f"{case}.rank0.npz")
        for rank in range(HOSTS):
            result = load(distributed / f"{case}.rank{rank}.npz")
            assert sorted(result) == sorted(expected)
            for key in expected:
                tolerance = {"atol": 1e-5} if key.startswith("weight_") else {"rtol": 1e-5, "atol": 1e-6}
                np.testing.assert_allclose(result[key], expected[key], **tolerance,
                                           err_msg=f"{case}, rank {rank}, {key}")


def test_cleanup_runs_on_every_host_of_the_hostfile(hosts):
    process = subprocess.run(launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--cleanup", "--",
                                                   f"nothing_runs_this_{os.getpid()}.py"],
                             capture_output=True, text=True, timeout=60, env=quiet_env(**hosts["env"]))
    assert_ok(process)
    reports = [line for line in process.stdout.splitlines() if f"running nothing_runs_this_{os.getpid()}.py" in line]
    assert len(reports) == HOSTS and all("sent SIGTERM to 0 process(es)" in line for line in reports), reports
