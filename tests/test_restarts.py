"""`tarantella --max-restarts`: real jobs under the real launcher, with ranks that raise, are
killed (mid-step, mid-backup, during the restart itself), fail at start-up, or lose their host.

Each test checks the exit status, the restart lines, and the final weights against the same
job without faults. The default suite runs a fast slice (ranks without TensorFlow, and one
training job); the rest runs with TNT_RESTART_TESTS=1 (docs/running.md, Long jobs):

    TNT_RESTART_TESTS=1 .venv/bin/python -m pytest -q tests/test_restarts.py
"""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import WORKERS, launcher_command, load_npz, quiet_env

JOB = WORKERS / "long_job.py"
PLAIN = WORKERS / "plain_ranks.py"
every_test = pytest.mark.skipif(os.environ.get("TNT_RESTART_TESTS") != "1",
                                reason="set TNT_RESTART_TESTS=1 to run every restart test")
_RESTART = re.compile(r"tarantella: restart (\d+) of (\d+) after the job failed \(exit status (\d+)\): (.*) Resuming "
                      r"from (.*)\.")


def tarantella(*arguments, cwd, env=None, timeout=300):
    return subprocess.run(launcher_command() + [str(a) for a in arguments], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=quiet_env(**(env or {})))


def restart_lines(stderr):
    return [_RESTART.fullmatch(line) for line in stderr.splitlines() if line.startswith("tarantella: restart ")]


def last_line(text):
    return text.strip().splitlines()[-1]


def report(process):
    return f"exit {process.returncode}\nstdout:\n{process.stdout[-3000:]}\nstderr:\n{process.stderr[-6000:]}"


_references = {}


def uninterrupted(tmp_path_factory, ranks=2, *worker_arguments):
    """The master's results of the same job without faults (and without --max-restarts), once per session."""
    key = (ranks, worker_arguments)
    if key not in _references:
        out = tmp_path_factory.mktemp("uninterrupted")
        process = tarantella("-n", ranks, "--no-gpu", "--", JOB, out, *worker_arguments, cwd=out)
        assert process.returncode == 0, report(process)
        _references[key] = load_npz(out / "weights.npz")
    return _references[key]


def serial_keras(tmp_path_factory, *worker_arguments):
    """The master's results of the same job run by plain Keras, without tarantella, once per session."""
    key = ("serial", worker_arguments)
    if key not in _references:
        out = tmp_path_factory.mktemp("serial")
        process = subprocess.run([sys.executable, str(JOB), str(out), "--serial", *worker_arguments],
                                 capture_output=True, text=True, env=quiet_env(), timeout=300, cwd=out)
        assert process.returncode == 0, report(process)
        _references[key] = load_npz(out / "weights.npz")
    return _references[key]


def assert_same_results(result, expected, exact=True):
    assert sorted(result) == sorted(expected)
    for key in expected:
        if exact:
            np.testing.assert_array_equal(result[key], expected[key], err_msg=key)
        else:  # another number of ranks: the tolerance of the suite's rank-count equality
            tolerance = {"atol": 1e-5} if "_weight" in key else {"rtol": 1e-5, "atol": 1e-6}
            np.testing.assert_allclose(result[key], expected[key], **tolerance, err_msg=key)


def files_for(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    process = subprocess.run([sys.executable, str(JOB), str(folder), "--make-files"],
                             capture_output=True, text=True, env=quiet_env(), timeout=120)
    assert process.returncode == 0, report(process)
    return folder


# -- the fast slice: ranks without TensorFlow -------------------------------------------------------

def test_failing_twice_with_one_restart_ends_with_the_last_failure(tmp_path):
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--", PLAIN, "fail-on-attempts", "0,1",
                         cwd=tmp_path, timeout=60)
    assert process.returncode == 1, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None, report(process)
    assert lines[0].group(1, 2, 3) == ("1", "1", "1")
    assert re.fullmatch(r"rank 1 on host \S+ raised RuntimeError\.", lines[0].group(4)), lines[0].group(4)
    assert lines[0].group(5) == "the start (no complete backup yet)"
    assert re.fullmatch(r"tarantella: no restart left \(--max-restarts 1\); the job failed \(exit status 1\): "
                        r"rank 1 on host \S+ raised RuntimeError\.", last_line(process.stderr)), report(process)
    assert "attempt 1 done" not in process.stdout
    assert os.listdir(tmp_path) == [], "an empty backup folder is not left behind"


def test_a_rank_failing_at_start_up_after_a_restart_is_restarted_again(tmp_path):
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 2, "--", PLAIN, "fail-on-attempts", "0,startup1",
                         cwd=tmp_path, timeout=60)
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert [line.group(1, 2) for line in lines] == [("1", "2"), ("2", "2")], report(process)
    assert "raised RuntimeError" in lines[0].group(4) and "raised FileNotFoundError" in lines[1].group(4)
    assert "rank 0 attempt 2 done" in process.stdout and "rank 1 attempt 2 done" in process.stdout
    assert os.listdir(tmp_path) == [], "the backups are removed after a good end"


def _send_sigterm_to_the_command(launcher):
    launcher.send_signal(signal.SIGTERM)


def _press_ctrl_c(launcher):
    """What a terminal does on Ctrl+C: SIGINT to every process of the foreground group, the
    command, its MPI launcher and the ranks alike."""
    os.killpg(launcher.pid, signal.SIGINT)


@pytest.mark.parametrize("stop, signum", [(_send_sigterm_to_the_command, signal.SIGTERM),
                                          (_press_ctrl_c, signal.SIGINT)], ids=["sigterm", "ctrl-c"])
def test_stopping_the_command_never_restarts(stop, signum, tmp_path):
    command = launcher_command() + ["-n", "2", "--no-gpu", "--max-restarts", "3", "--", str(PLAIN), "run-forever"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=quiet_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        running = 0
        for line in launcher.stderr:
            running += line.endswith(": running\n")
            if running == 2:
                break
        stop(launcher)
        assert launcher.wait(timeout=20) == 128 + signum
        stderr = launcher.stderr.read()
        # Nothing of the job is left: no rank, no MPI launcher, no restarted attempt.
        assert _processes_in_group(launcher.pid) == [], stderr
    finally:
        if launcher.poll() is None or _processes_in_group(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "tarantella: restart" not in stderr, stderr
    assert last_line(stderr) == f"tarantella: stopped every rank on {signal.Signals(signum).name}.", stderr


def _processes_in_group(group, settle_s=5):
    """The pids still in process group `group`, after up to `settle_s` for them to end."""
    deadline = time.monotonic() + settle_s
    while True:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _group_of(int(pid)) == group]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _group_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):  # ended meanwhile
        return None


def test_the_next_backup_removes_a_partial_file_whose_writer_is_gone(tmp_path):
    """A rank stopped while it wrote (Ctrl+C, SIGKILL) leaves its hidden partial file; the next write
    of that backup removes it, but not the partial file of a writer that still runs."""
    from tarantella.common import backup_files
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, target = socket.gethostname(), backup_files.path_of(tmp_path, 1)
    abandoned = tmp_path / f"{backup_files.PARTIAL_PREFIX}{host}-{gone.pid}-fit-1.tntbackup"
    writing = tmp_path / f"{backup_files.PARTIAL_PREFIX}{host}-{os.getppid()}-fit-1.tntbackup"
    other_fit = tmp_path / f"{backup_files.PARTIAL_PREFIX}{host}-{gone.pid}-fit-2.tntbackup"
    for path in (abandoned, writing, other_fit):
        path.write_bytes(b"half")
    backup_files.write(target, {"epoch": 1}, [np.arange(3.0)])
    assert sorted(os.listdir(tmp_path)) == sorted(["fit-1.tntbackup", writing.name, other_fit.name])
    assert backup_files.read_header(target)["epoch"] == 1


def test_a_refused_command_line_is_not_restarted(tmp_path):
    process = tarantella("-n", 2, "--max-restarts", 2, "--", "missing_program.py", cwd=tmp_path, timeout=60)
    assert process.returncode == 2, report(process)
    assert "tarantella: restart" not in process.stderr
    assert last_line(process.stderr).startswith("tarantella: error: the program 'missing_program.py' does not exist")
    process = tarantella("-n", 2, "--backup-dir", tmp_path, "--", PLAIN, "chatter", cwd=tmp_path, timeout=60)
    assert process.returncode == 2 and "--backup-dir only goes with --max-restarts" in process.stderr, report(process)


def test_inside_slurm_each_attempt_gets_the_allocation_and_a_backup_folder_named_by_the_job(tmp_path):
    process = tarantella("--max-restarts", 2, "--backup-every-steps", 50, "--dry-run", "--", "train.py", cwd=tmp_path,
                         env={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NTASKS_PER_NODE": "2"},
                         timeout=60)
    assert process.returncode == 0, report(process)
    assert " -hosts node1:2,node2:2 -ppn 2 -n 4 " in process.stdout, process.stdout
    assert f"  TNT_BACKUP_DIR={tmp_path}/tarantella-backups/train-slurm42\n" in process.stdout, process.stdout
    assert "  TNT_BACKUP_EVERY_STEPS=50\n" in process.stdout and "  TNT_RESTART_ATTEMPT=0\n" in process.stdout
    assert os.listdir(tmp_path) == [], "a dry run creates no folder"


# -- the fast slice: one training job ---------------------------------------------------------------

def test_a_rank_killed_mid_epoch_resumes_and_ends_with_the_uninterrupted_weights(tmp_path, tmp_path_factory):
    expected = uninterrupted(tmp_path_factory)
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 2, "--backup-every-steps", 2, "--", JOB, tmp_path,
                         cwd=tmp_path, env={"FAULT": "attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill"})
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None, report(process)
    assert lines[0].group(3) == "9" and re.fullmatch(r"rank 1 on host \S+ \(pid \d+\) ended: Killed \(signal 9\)\.",
                                                     lines[0].group(4)), lines[0].group(0)
    assert lines[0].group(5).startswith("fit #1 at epoch 2, step 2 (backup of "), lines[0].group(0)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)
    assert os.listdir(tmp_path) == ["weights.npz"], "the backups are removed after a good end"


def test_a_job_killed_mid_epoch_and_restarted_ends_with_serial_keras_weights(tmp_path, tmp_path_factory):
    """fit's defaults on arrays (shuffle=True) in a seeded script, without Dropout (its masks depend
    on the number of ranks): the resumed epochs take serial Keras' own orders."""
    expected = serial_keras(tmp_path_factory, "--no-dropout")
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 2, "--", JOB, tmp_path,
                         "--no-dropout", cwd=tmp_path, env={"FAULT": "attempt=0,rank=1,fit=1,epoch=2,step=3,how=kill"})
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0].group(5).startswith("fit #1 at epoch 3, step 2 "), report(process)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected, exact=False)


# -- the rest: TNT_RESTART_TESTS=1 ------------------------------------------------------------------

@every_test
@pytest.mark.parametrize("kind", ["arrays", "dataset", "pydataset", "files"])
@pytest.mark.parametrize("where", ["mid-epoch", "epoch-end"])
def test_resuming_equals_the_uninterrupted_run_for_every_input(kind, where, tmp_path, tmp_path_factory):
    if kind == "files":
        files = _references.setdefault("files", files_for(tmp_path_factory))
        extra = ("--input", "files", "--files", files)
    else:
        extra = ("--input", kind)
    expected = uninterrupted(tmp_path_factory, 2, *extra)
    step = 4 if where == "mid-epoch" else 0
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 3, "--", JOB, tmp_path,
                         *extra, cwd=tmp_path, env={"FAULT": f"attempt=0,rank=0,fit=1,epoch=2,step={step},how=raise"})
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None, report(process)
    resumed_at = "epoch 3, step 3" if where == "mid-epoch" else "epoch 3, step 0"
    assert lines[0].group(5).startswith(f"fit #1 at {resumed_at} "), lines[0].group(0)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)


@every_test
@pytest.mark.parametrize("kind", ["arrays", "dataset", "pydataset", "files"])
def test_a_resumed_job_ends_with_serial_keras_weights_for_every_input(kind, tmp_path, tmp_path_factory):
    if kind == "files":
        files = _references.setdefault("files", files_for(tmp_path_factory))
        extra = ("--input", "files", "--files", files, "--no-dropout")
    else:
        extra = ("--input", kind, "--no-dropout")
    expected = serial_keras(tmp_path_factory, *extra)
    process = tarantella("-n", 3, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 3, "--", JOB, tmp_path,
                         *extra, cwd=tmp_path, env={"FAULT": "attempt=0,rank=2,fit=1,epoch=1,step=4,how=raise"})
    assert process.returncode == 0, report(process)
    assert len(restart_lines(process.stderr)) == 1, report(process)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected, exact=False)


@every_test
def test_a_finished_fit_is_not_trained_again_after_a_restart(tmp_path, tmp_path_factory):
    expected = uninterrupted(tmp_path_factory, 2, "--fits", 2)
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--", JOB, tmp_path, "--fits", 2, cwd=tmp_path,
                         env={"FAULT": "attempt=0,rank=1,fit=2,epoch=2,step=1,how=raise"})
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0].group(5).startswith("fit #2 at epoch 3, step 0 "), report(process)
    # Attempt 0 trained fit 1 (28 steps); attempt 1 restored its end at once, and replayed nothing of fit 2.
    assert process.stdout.splitlines().count("fit 1 trained 28 steps") == 1, process.stdout
    assert "fit 1 trained 0 steps" in process.stdout and "fit 2 trained 14 steps" in process.stdout, process.stdout
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)


@every_test
def test_ctrl_c_while_training_stops_the_job_and_keeps_its_backup(tmp_path):
    """Every rank gets SIGINT (a KeyboardInterrupt inside fit) while the command gets it too: the job
    stops, is not restarted, and the backup stays for a later run to resume from."""
    command = launcher_command() + ["-n", "2", "--no-gpu", "--max-restarts", "3", "--backup-every-steps", "2",
                                    "--", str(JOB), str(tmp_path)]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=quiet_env(STEP_SLEEP="0.05"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for_backup(tmp_path), "no backup within 120 s"
        assert len(rank_pids(tmp_path, "long_job.py")) == 2
        _press_ctrl_c(launcher)
        stdout, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGINT, stderr
        assert _processes_in_group(launcher.pid) == [], stderr
    finally:
        if launcher.poll() is None or _processes_in_group(launcher.pid, settle_s=0):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "tarantella: restart" not in stderr, stderr
    assert last_line(stderr) == "tarantella: stopped every rank on SIGINT.", stderr
    assert "fit 1 trained" not in stdout, "the job was stopped before it ended"
    assert complete_backups(tmp_path), "the backup of a stopped job stays, to resume from"


def run_until_signalled(out, backups, signal_name, send_signal, after="fit 1 epoch 1 step 2 done"):
    """Runs the job with --save-on-signal SIGNAL_NAME, and calls `send_signal(launcher)` once rank 0 said
    `after` (None: half a second after the start). Returns the finished process (stdout, stderr) and what was left of its process group."""
    command = launcher_command() + ["-n", "2", "--no-gpu", "--save-on-signal", signal_name, "--backup-dir",
                                    str(backups), "--", str(JOB), str(out)]
    launcher = subprocess.Popen(command, cwd=out, env=quiet_env(STEP_SLEEP="0.2", ANNOUNCE_STEPS="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout = []
        if after is None:
            time.sleep(0.5)  # the command has started, its ranks not yet
            send_signal(launcher)
        for line in launcher.stdout if after is not None else ():
            stdout.append(line)
            if line.strip() == after:
                send_signal(launcher)
                break
        rest, stderr = launcher.communicate(timeout=60)
        left = _processes_in_group(launcher.pid)
    finally:
        if launcher.poll() is None or _processes_in_group(launcher.pid, settle_s=0):
            os.killpg(launcher.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, launcher.returncode, "".join(stdout) + rest, stderr), left


def test_a_backup_that_cannot_be_written_fails_the_job_naming_the_folder_and_the_fix(full_disk, tmp_path):
    """The master writes backups from a thread of its own: its failure still reaches the program, as an
    error of the master that names the backup and the fix."""
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 0, "--backup-dir", full_disk, "--", JOB, tmp_path,
                         cwd=tmp_path)
    assert process.returncode == 1, report(process)
    assert (f"The automatic backup of fit #1 to {full_disk}/fit-1.tntbackup failed: [Errno 28] No space left on "
            "device. Give --backup-dir a folder with room that every rank can read") in process.stderr, report(process)
    assert re.fullmatch(r"tarantella: the job failed \(exit status 1\): rank 0 on host \S+ raised OSError\.",
                        last_line(process.stderr)), report(process)


def test_a_signal_tarantella_does_not_save_on_is_refused_naming_those_it_does(tmp_path):
    process = tarantella("-n", 2, "--save-on-signal", "KILL", "--", PLAIN, "chatter", cwd=tmp_path)
    assert process.returncode == 2, report(process)
    assert "argument --save-on-signal: 'KILL' is not a signal tarantella saves on; use USR1, USR2 or TERM" in \
        process.stderr, report(process)


@pytest.mark.parametrize("signal_name, receiver, after", [
    ("USR1", "command", "fit 1 epoch 1 step 2 done"), ("USR1", "rank 1", "fit 1 epoch 1 step 2 done"),
    ("TERM", "command", "fit 1 epoch 1 step 2 done"), ("USR1", "command", None)])
def test_the_warning_signal_saves_at_one_step_and_the_same_command_resumes_to_the_uninterrupted_weights(
        signal_name, receiver, after, tmp_path, tmp_path_factory):
    """The cluster's warning (SIGUSR1, or SIGTERM with a grace) to the command, or to one rank only (as
    `scancel --signal` sends it to the tasks), mid-epoch or as the job starts (after=None: before any rank
    listens): every rank stops at the same step after the master's backup, with status 75; the same
    command then resumes and ends with the uninterrupted run's weights, bit for bit."""
    expected = uninterrupted(tmp_path_factory)
    backups = tmp_path / "backups"

    def send(launcher):
        pid = launcher.pid if receiver == "command" else rank_pids(tmp_path, "long_job.py")[1]
        os.kill(pid, getattr(signal, "SIG" + signal_name))

    process, left = run_until_signalled(tmp_path, backups, signal_name, send, after)
    assert process.returncode == 75, report(process)
    assert left == [], report(process)
    saved = re.fullmatch(rf"tarantella: rank 0 on host \S+ backed up fit #1 at epoch (\d+), step (\d+) in \S+ on "
                         rf"SIG{signal_name}; every rank stopped\. The same command resumes from there \(exit status "
                         r"75\)\.", last_line(process.stderr))
    assert saved, report(process)
    epoch, step = int(saved.group(1)), int(saved.group(2))
    if after is None:
        assert (epoch, step) == (1, 1), "a warning before fit stops it after its first step"
    else:
        assert (epoch, step) >= (2, 3), "the steps before the signal trained"  # epoch 2 is the 1-based epoch 1
        assert epoch <= 2 and step <= 5, "the ranks stopped within two steps of the signal"
    assert "fit 1 trained" not in process.stdout
    assert complete_backups(backups) == ["fit-1.tntbackup"]
    resumed = tarantella("-n", 2, "--no-gpu", "--save-on-signal", signal_name, "--backup-dir", backups, "--", JOB,
                         tmp_path, cwd=tmp_path)
    assert resumed.returncode == 0, report(resumed)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)
    assert not complete_backups(backups), "the backups are removed after a good end"


@every_test
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_rank_killed_at_a_random_moment_costs_nothing_but_time(seed, tmp_path, tmp_path_factory):
    expected = uninterrupted(tmp_path_factory)
    chance = random.Random(seed)
    victim_rank, delay = chance.randrange(2), chance.uniform(0.0, 1.0)

    def a_rank_some_time_after_the_first_backup():
        if not wait_for_backup(tmp_path):
            return None
        time.sleep(delay)
        pids = rank_pids(tmp_path, "long_job.py")
        return pids[victim_rank] if len(pids) == 2 else None

    process, killed = run_and_kill(tmp_path, ["--max-restarts", 1, "--backup-every-steps", 2],
                                   a_rank_some_time_after_the_first_backup, env={"STEP_SLEEP": "0.05"})
    assert killed, "the rank to kill was never found"
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None and lines[0].group(3) == "9", report(process)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)


@every_test
def test_the_master_killed_mid_backup_leaves_the_previous_backup_whole(tmp_path, tmp_path_factory):
    expected = uninterrupted(tmp_path_factory, 2, "--width", 1024)

    def writer_of_a_partial_backup():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for folder, _, names in os.walk(tmp_path):
                for name in names:
                    match = re.match(r"\.tnt-partial-.*?-(\d+)-fit-\d+\.tntbackup$", name)
                    if match and name.startswith(".tnt-partial-") and complete_backups(tmp_path):
                        return int(match.group(1))
            time.sleep(0.001)
        return None

    process, killed = run_and_kill(tmp_path, ["--max-restarts", 1, "--backup-every-steps", 1],
                                   writer_of_a_partial_backup, worker=("--width", 1024))
    assert killed, "no backup was caught while being written"
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and "Killed (signal 9)" in lines[0].group(4), report(process)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)


@every_test
def test_a_rank_killed_during_the_restart_itself_is_restarted_again(tmp_path, tmp_path_factory):
    expected = uninterrupted(tmp_path_factory)
    seen_restart = threading.Event()

    def a_rank_of_the_second_attempt():
        seen_restart.wait(120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # as soon as it runs: while it starts and restores
            pids = rank_pids(tmp_path, "long_job.py")
            if pids:
                return pids[-1]
            time.sleep(0.01)
        return None

    process, killed = run_and_kill(tmp_path, ["--max-restarts", 2, "--backup-every-steps", 2],
                                   a_rank_of_the_second_attempt,
                                   env={"FAULT": "attempt=0,rank=1,fit=1,epoch=1,step=3,how=raise"},
                                   on_line=lambda line: line.startswith("tarantella: restart 1 of 2") and seen_restart.set())
    assert killed
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert [line.group(1) for line in lines] == ["1", "2"], report(process)
    assert all(line.group(5).startswith("fit #1 at epoch 2, step 2 ") for line in lines), report(process)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected)


@every_test
def test_a_training_job_failing_twice_with_one_restart_ends_with_the_second_failure(tmp_path):
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 2, "--", JOB, tmp_path,
                         cwd=tmp_path, env={"FAULT": "attempt=0,rank=1,fit=1,epoch=1,step=3,how=raise;"
                                                     "attempt=1,rank=0,fit=1,epoch=2,step=1,how=exit"})
    assert process.returncode == 1, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and "raised RuntimeError" in lines[0].group(4), report(process)
    assert re.fullmatch(r"tarantella: no restart left \(--max-restarts 1\); the job failed \(exit status 1\): rank 0 "
                        r"on host \S+ left early: .*", last_line(process.stderr)), report(process)
    # The backups stay for a later run with --backup-dir.
    folders = os.listdir(tmp_path / "tarantella-backups")
    assert len(folders) == 1 and "fit-1.tntbackup" in os.listdir(tmp_path / "tarantella-backups" / folders[0])


# -- helpers ---------------------------------------------------------------------------------------

def complete_backups(folder):
    return [name for _, _, names in os.walk(folder) for name in names if re.fullmatch(r"fit-\d+\.tntbackup", name)]


def wait_for_backup(folder, timeout=120):
    deadline = time.monotonic() + timeout
    while not complete_backups(folder) and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(complete_backups(folder))


def rank_pids(out, script):
    """Process ids of the ranks running `script` with `out`, by rank."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                arguments = file.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/environ", "rb") as file:
                environment = dict(item.split("=", 1) for item in file.read().decode(errors="replace").split("\0")
                                   if "=" in item)
        except OSError:
            continue
        if any(argument.endswith("rank_entry.py") for argument in arguments) and str(out) in arguments and \
                any(argument.endswith(script) for argument in arguments) and "PMI_RANK" in environment:
            found[int(environment["PMI_RANK"])] = int(pid)
    return [found[rank] for rank in sorted(found)]


def run_and_kill(out, options, choose_victim, worker=(), env=None, on_line=None):
    """Runs the job; kills (SIGKILL) the process `choose_victim()` returns, once. Returns (process, killed)."""
    command = launcher_command() + ["-n", "2", "--no-gpu", *map(str, options), "--", str(JOB), str(out),
                                    *map(str, worker)]
    launcher = subprocess.Popen(command, cwd=out, env=quiet_env(**(env or {})), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed, stderr_lines = [], []

    def read_stderr():
        for line in launcher.stderr:
            stderr_lines.append(line)
            if on_line:
                on_line(line)

    def kill():
        victim = choose_victim()
        if victim:
            try:
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
            except ProcessLookupError:
                pass

    threads = [threading.Thread(target=read_stderr, daemon=True), threading.Thread(target=kill, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        stdout = launcher.stdout.read()
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    threads[0].join(timeout=10)
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, "".join(stderr_lines)), bool(killed)


# -- fewer ranks: a host lost between attempts ------------------------------------------------------

@pytest.fixture(scope="module")
def namespace_hosts(tmp_path_factory):
    if os.environ.get("TNT_RESTART_TESTS") != "1":
        pytest.skip("set TNT_RESTART_TESTS=1 to run every restart test")
    import test_multihost_netns
    hosts = test_multihost_netns.hosts.__wrapped__(tmp_path_factory)  # the multi-host test's namespaces
    try:
        yield dict(next(hosts), namespace=test_multihost_netns._namespace)
    finally:
        hosts.close()


def test_a_host_lost_between_attempts_is_left_out_and_the_job_ends_with_the_uninterrupted_weights(
        namespace_hosts, tmp_path, tmp_path_factory):
    # Three hosts with a rank each; the third host's rank is killed and the host removed. The
    # job goes on with two ranks and the same global batch.
    expected = uninterrupted(tmp_path_factory, 3, "--no-dropout")
    lost = namespace_hosts["namespace"](3)

    def remove_the_host(line):
        if line.startswith("long_job: failing now"):
            pids = subprocess.run(["ip", "netns", "pids", lost], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", lost], capture_output=True)

    command = launcher_command() + ["--hostfile", str(namespace_hosts["hostfile"]), "--no-gpu", "--max-restarts", "1",
                                    "--min-ranks", "2", "--backup-every-steps", "2", "--", str(JOB), str(tmp_path),
                                    "--no-dropout"]
    launcher = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=quiet_env(
                                    **namespace_hosts["env"], FAULT="attempt=0,rank=2,fit=1,epoch=1,step=3,how=kill"))
    stderr_lines = []

    def read_stderr():
        for line in launcher.stderr:
            stderr_lines.append(line)
            remove_the_host(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        stdout = launcher.stdout.read()
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    reader.join(timeout=10)
    process = subprocess.CompletedProcess(command, launcher.returncode, stdout, "".join(stderr_lines))
    assert process.returncode == 0, report(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None, report(process)
    addresses = namespace_hosts["hostfile"].read_text().split()
    assert lines[0].group(5).startswith("fit #1 at epoch 2, step 2 "), lines[0].group(0)
    assert lines[0].group(5).endswith(f" on 2 ranks (1 on each of {addresses[0]}, {addresses[1]}; left out, not "
                                      f"answering: {addresses[2]})"), lines[0].group(0)
    assert_same_results(load_npz(tmp_path / "weights.npz"), expected, exact=False)
