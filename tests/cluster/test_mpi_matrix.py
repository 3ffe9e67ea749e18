"""The `tarantella` command and the MPI's own launcher with each MPI the project supports, from
PyPI: MPICH (the suite's venv), Open MPI 5 and Intel MPI (venvs of their own, tests/cluster/
conftest.py). Each is the real MPI, started as a user would start it: nothing here sets OMPI_*,
I_MPI_* or SLURM_* variables to stand in for what the command must pass itself.

The default suite runs one of these tests, the quick start with Open MPI on 2 ranks, as root where
the suite runs as root (MPICH runs every other test). All of them (docs/running.md has the table):
    TNT_CLUSTER_TESTS=1 .venv/bin/python -m pytest -q tests/cluster
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import time
import uuid

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, cores_seen, load_npz
from netns_hosts import namespace_hosts, network_namespace_of

from .conftest import ALL_TESTS, CASE, MPIS, TRAIN, assert_restarted_once_like_the_uninterrupted_run, mpi_env

SCENARIOS = WORKERS / "scenarios.py"
PLAIN = WORKERS / "plain_ranks.py"
only_with_cluster_tests = pytest.mark.skipif(not ALL_TESTS, reason="set TNT_CLUSTER_TESTS=1 to run")


def everywhere_but(*default_cases):
    """Every MPI, the given (key, ...) cases in the default suite, the rest with TNT_CLUSTER_TESTS=1."""
    def cases(*rest):
        return [pytest.param(*case, marks=() if case in default_cases else only_with_cluster_tests,
                             id="-".join(map(str, case))) for case in rest]
    return cases


def run(command, mpi, timeout=300, user=None, **extra_env):
    command = [str(part) for part in command]
    env = mpi_env(**{**mpi.env(), **extra_env})
    if user:
        command = user.command(command)
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def last_line(text):
    return text.strip().splitlines()[-1]


def assert_ranks_trained_like_serial(out, ranks, serial):
    for rank in range(ranks):
        result = load_npz(out / f"{CASE}.rank{rank}.npz")
        for key in (key for key in serial if key.startswith("weight_")):
            np.testing.assert_allclose(result[key], serial[key], rtol=0, atol=1e-5, err_msg=f"rank {rank}, {key}")


# -- the quick start: 2 ranks, and 3 on 2 cores ------------------------------------------------

@pytest.mark.parametrize("key, ranks, who", everywhere_but(("openmpi", 2, "root"))(
    *[(key, ranks, who) for key in MPIS for ranks in (2, 3) for who in ("root", "user")]))
def test_the_quick_start_trains_like_serial_keras(mpi_venvs, unprivileged_user, serial_weights, tmp_path, key, ranks,
                                                 who):
    mpi = mpi_venvs(key)
    if who == "root" and os.geteuid() != 0:
        pytest.skip("the suite does not run as root")
    user = unprivileged_user if who == "user" else None
    out = user.folder() if user else tmp_path
    process = run([mpi.bin("tarantella"), "-n", ranks, "--no-gpu", "--", TRAIN, "--mode", "tnt", "--out", out,
                   "--cases", CASE], mpi, user=user)
    assert_ok(process)
    assert_ranks_trained_like_serial(out, ranks, serial_weights)
    if user:
        assert {path.stat().st_uid for path in out.iterdir()} == {user.uid}, "the ranks ran as the user"


# -- a failing rank ----------------------------------------------------------------------------

FAILURES = {
    "raise-on-rank-1": (r"rank 1 on host {host} raised RuntimeError", {1}),
    "kill-rank-1-mid-epoch": (r"rank 1 on host {host} \(pid \d+\) ended: Killed \(signal 9\)", {9, 137, 255}),
    "os-exit-0-on-rank-1": (r"rank 1 on host {host} left early: it ended (with status 0 )?without finishing the "
                            r"program \(e\.g\. os\._exit\), .*", {1, 255}),
}


@only_with_cluster_tests
@pytest.mark.parametrize("scenario", FAILURES)
@pytest.mark.parametrize("key", MPIS)
def test_a_failing_rank_ends_the_job_within_seconds_naming_rank_and_host(mpi_venvs, key, scenario):
    mpi = mpi_venvs(key)
    how, statuses = FAILURES[scenario]
    process = run([mpi.bin("tarantella"), "-n", "2", "--no-gpu", "-x", "TNT_COLLECTIVE_TIMEOUT=4", "--", SCENARIOS,
                   scenario], mpi, timeout=120)
    ended = time.time()
    failed_at = float(re.search(r"rank 1: failing at ([\d.]+)", process.stderr).group(1))
    assert process.returncode in statuses, process.stderr
    assert re.fullmatch(r"tarantella: the job failed \(exit status \d+\): "
                        + how.format(host=re.escape(socket.gethostname())) + r"\.", last_line(process.stderr)), \
        process.stderr
    assert ended - failed_at < 10, f"the job ended {ended - failed_at:.1f} s after rank 1 failed"


@only_with_cluster_tests
@pytest.mark.parametrize("key", MPIS)
def test_a_rank_killed_mid_epoch_is_restarted_and_ends_with_the_uninterrupted_weights(mpi_venvs, key, tmp_path):
    mpi = mpi_venvs(key)
    job = WORKERS / "long_job.py"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    assert_ok(run([mpi.bin("tarantella"), "-n", "2", "--no-gpu", "--", job, reference], mpi))
    process = run([mpi.bin("tarantella"), "-n", "2", "--no-gpu", "--max-restarts", "1", "--backup-every-steps", "2",
                   "--backup-dir", tmp_path / "backups", "--", job, resumed], mpi,
                  FAULT="attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill")
    assert_restarted_once_like_the_uninterrupted_run(process, reference, resumed, tmp_path / "backups")


# -- environment and hostfile across two hosts -------------------------------------------------

@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with namespace_hosts(2, tmp_path_factory.mktemp("hosts")) as hosts:
        yield hosts


def remote_start(key, mpi, ssh):
    """What makes each MPI's launcher reach the hosts through the ssh stand-in: its own settings."""
    if key == "openmpi":
        return {"TNT_MPIEXEC": f"{mpi.launcher_path} --prtemca plm_ssh_agent {ssh}"}
    if key == "openmpi4":
        # ssh starts orted with a clean environment: it learns where the unpacked packages are from its command.
        settings = " ".join(f"{name}={value}" for name, value in mpi.env().items() if name != "TNT_MPIEXEC")
        agent = shlex.quote(f"env {settings} {mpi.venv / 'debian/usr/bin/orted'}")
        return {"TNT_MPIEXEC": f"{mpi.launcher_path} --mca plm_rsh_agent {ssh} --mca orte_launch_agent {agent}"}
    if key == "impi":
        return {"I_MPI_HYDRA_BOOTSTRAP": "ssh", "I_MPI_HYDRA_BOOTSTRAP_EXEC": str(ssh)}
    return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(ssh)}


@only_with_cluster_tests
@pytest.mark.parametrize("key", MPIS)
def test_variables_and_a_hostfile_of_two_hosts_reach_every_rank(mpi_venvs, two_hosts, serial_weights, tmp_path,
                                                                key):
    mpi = mpi_venvs(key)
    # The ssh stand-in starts the remote side with a clean environment: these arrive through MPI.
    process = run([mpi.bin("tarantella"), "--hostfile", two_hosts.hostfile, "--no-gpu", "-x",
                   "GREETING=from the launcher", "--", WORKERS / "multihost.py", tmp_path, CASE],
                  mpi, PYTHONPATH="/nonexistent/forwarded-by-name", **remote_start(key, mpi, two_hosts.ssh))
    assert_ok(process)
    namespaces = set()
    for rank in range(2):
        line = next(line for line in process.stdout.splitlines() if line.startswith(f"rank {rank}: "))
        assert line.endswith(" PYTHONPATH=/nonexistent/forwarded-by-name GREETING=from the launcher node ranks 1"), line
        namespaces.add(line.split()[2])
    assert len(namespaces) == 2 and network_namespace_of() not in namespaces, "one rank on each host"
    assert_ranks_trained_like_serial(tmp_path, 2, serial_weights)


# -- Ctrl+C and SIGTERM ------------------------------------------------------------------------

def descendants(pid):
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as file:
                children.setdefault(int(file.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except OSError:
            continue
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def still_running(pids):
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                stat = file.read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(stat.split(")")[0] + ")")
    return alive


@only_with_cluster_tests
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("key", MPIS)
def test_a_signal_to_the_command_stops_every_rank_and_leaves_no_process(mpi_venvs, key, signum):
    mpi = mpi_venvs(key)
    marker = f"marker-{uuid.uuid4().hex}"
    launcher = subprocess.Popen([str(mpi.bin("tarantella")), "-n", "2", "--no-gpu", "--", str(PLAIN), "run-forever",
                                 marker], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=mpi_env(**mpi.env()), start_new_session=True)
    started = set()
    try:
        running = 0
        for line in launcher.stderr:
            running += line.endswith(": running\n")
            if running == 2:
                break
        started = descendants(launcher.pid)  # the MPI launcher, its daemons or proxies, the ranks
        launcher.send_signal(signum)
        sent = time.monotonic()
        assert launcher.wait(timeout=20) == 128 + signum
        assert time.monotonic() - sent < 10
        assert last_line(launcher.stderr.read()) == f"tarantella: stopped every rank on {signum.name}."
        time.sleep(5)
        assert len(started) >= 3 and still_running(started) == [], still_running(started)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- what the MPI refuses, and the MPI's own launcher ----------------------------------------

@only_with_cluster_tests
@pytest.mark.parametrize("key", MPIS)
def test_when_the_mpi_cannot_reach_a_host_the_last_line_names_it_the_cause_and_the_fix(mpi_venvs, tmp_path, key):
    mpi = mpi_venvs(key)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("no-such-host-1.invalid\nno-such-host-2.invalid\n")  # real ssh cannot resolve them
    process = run([mpi.bin("tarantella"), "--hostfile", hostfile, "--no-gpu", "--", PLAIN, "chatter"], mpi,
                  timeout=120)
    assert process.returncode != 0
    assert re.fullmatch(rf"tarantella: {mpi.name}'s {mpi.launcher_name} (could not start|refused to start) the job: "
                        r".+\. Fix: check that `ssh HOST true` works for every host without a password, and "
                        r"that the MPI is installed at the same path there\.", last_line(process.stderr)), \
        process.stderr


@only_with_cluster_tests
@pytest.mark.parametrize("key", MPIS)
def test_the_mpis_own_launcher_runs_the_ranks_without_the_command(mpi_venvs, serial_weights, tmp_path, key):
    mpi = mpi_venvs(key)
    # Open MPI's own switch, as a user running plain mpirun as root would give it.
    as_root = ["--allow-run-as-root"] if key.startswith("openmpi") and os.geteuid() == 0 else []
    process = run([mpi.launcher_path, *as_root, "-n", "2", mpi.bin("python"), TRAIN, "--mode", "tnt", "--out",
                   tmp_path, "--cases", CASE], mpi)
    assert_ok(process)
    assert_ranks_trained_like_serial(tmp_path, 2, serial_weights)


def test_an_mpiexec_of_another_mpi_than_the_library_is_refused_on_every_rank(mpi_venvs, tmp_path):
    # MPICH's mpiexec with Open MPI's library: each rank was a job of size 1, trained alone as the
    # master, and the job ended 0.
    mpich, open_mpi = mpi_venvs("mpich"), mpi_venvs("openmpi")
    process = run([mpich.launcher_path, "-n", "2", open_mpi.bin("python"), TRAIN, "--mode", "tnt", "--out",
                   tmp_path, "--cases", CASE], mpich, timeout=120)
    assert process.returncode != 0
    refusal = (r"RuntimeError: a Hydra mpiexec \(MPICH, Intel MPI, MVAPICH\) started 2 ranks, but the MPI library "
               r"that mpi4py loaded \(Open MPI v5[\d.]+\) made each of them a job of its own \(size 1\)")
    assert len(re.findall(refusal, process.stderr)) == 2, process.stderr
    assert not list(tmp_path.iterdir()), "no rank trained"


# -- cores per rank ----------------------------------------------------------------------------

@only_with_cluster_tests
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to share")
@pytest.mark.parametrize("key", MPIS)
def test_two_ranks_of_a_node_run_on_cores_of_their_own_whoever_binds_them(mpi_venvs, key):
    """Hydra (MPICH) leaves ranks unbound and tarantella splits the cores; Open MPI and Intel MPI
    bind 2 ranks to a core each by default, and tarantella keeps their binding. Either way every
    thread of a rank (XLA's and the input pipeline's pools, the communicator's) runs on its own cores."""
    mpi = mpi_venvs(key)
    seen = cores_seen(run([mpi.bin("tarantella"), "-n", "2", "--no-gpu", "--", WORKERS / "cores_seen.py"], mpi,
                          timeout=120), 2)
    assert not set(seen[0][0]) & set(seen[1][0]), seen
    assert seen[0][1] and seen[1][1], seen
