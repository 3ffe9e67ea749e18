"""The `tarantella` command under faults that do not need tarantella inside the ranks: a rank
failing before MPI starts, a reader that closes the output early, the command itself killed,
a host that never answers. The ranks use plain mpi4py, so each job takes about a second."""

import os
import re
import signal
import socket
import subprocess
import textwrap
import time
import uuid

import pytest

from conftest import WORKERS, launcher_command, quiet_env

PLAIN = WORKERS / "plain_ranks.py"


def start(*arguments, env=None, **popen):
    return subprocess.Popen(launcher_command() + list(arguments), env=quiet_env(**(env or {})),
                            start_new_session=True, text=True, **popen)


def processes_naming(word):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command_line = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in command_line:
            found.append(f"{pid}: {command_line}")
    return found


def wait_until_gone(word, seconds):
    deadline = time.monotonic() + seconds
    while processes_naming(word) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_naming(word)


def stop_leftovers(launcher, marker):
    """Whatever the test found, nothing it started may outlive it."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    for entry in processes_naming(marker):
        try:
            os.kill(int(entry.split(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_plain_job(scenario, timeout, **popen):
    """Runs `tarantella -n 2 -- plain_ranks.py SCENARIO` to its end; returns (returncode, stdout,
    stderr, seconds). Whatever happens, nothing it started outlives it."""
    marker = f"marker-{uuid.uuid4().hex}"
    started = time.monotonic()
    launcher = start("-n", "2", "--no-gpu", "--", str(PLAIN), scenario, marker,
                     **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen})
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    finally:
        stop_leftovers(launcher, marker)
    return launcher.returncode, stdout, stderr, time.monotonic() - started


def last_line(text):
    return text.strip().splitlines()[-1]


def test_a_rank_failing_before_mpi_starts_ends_the_job_naming_it_with_its_traceback_once():
    returncode, _, stderr, seconds = run_plain_job("fail-before-mpi", timeout=30)
    assert returncode == 1, stderr
    assert seconds < 10
    assert last_line(stderr) == (f"tarantella: the job failed (exit status 1): rank 1 on host "
                                 f"{socket.gethostname()} raised FileNotFoundError."), stderr
    assert stderr.count("No such file or directory: '/nonexistent/tarantella-test-data.npz'") == 1, stderr


def test_a_reader_that_closes_the_output_early_does_not_stop_the_job():
    # tarantella -n 2 -- program | head -n 5
    marker = f"marker-{uuid.uuid4().hex}"
    launcher = start("-n", "2", "--no-gpu", "--", str(PLAIN), "chatter", marker, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    first_lines = [launcher.stdout.readline() for _ in range(5)]
    launcher.stdout.close()
    try:
        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 0, stderr
    finally:
        stop_leftovers(launcher, marker)
    assert all(re.fullmatch(r"rank \d line \d+ x+\n", line) for line in first_lines), first_lines
    assert "rank 0: finished" in stderr and "rank 1: finished" in stderr
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout-closed", "stderr-closed"])
def test_a_job_started_with_a_closed_standard_stream_runs_to_its_end(closed):
    # tarantella ... >&- (or 2>&-): Python gives the command sys.stdout (sys.stderr) None. The
    # output thread died on it, and ranks with more output than a pipe holds blocked for ever;
    # with stderr closed the command exited 1 at once.
    open_stream = 2 if closed == 1 else 1
    returncode, stdout, stderr, _ = run_plain_job("chatter", timeout=60, preexec_fn=lambda: os.close(closed),
                                                  **{"stdout" if closed == 1 else "stderr": None})
    output = stdout if open_stream == 1 else stderr
    assert returncode == 0, output
    if open_stream == 1:  # everything the ranks printed still arrives on the open stream
        assert output.count(" line ") == 2 * 20000
    else:
        assert "Traceback" not in output, output


def test_a_child_process_left_running_does_not_keep_the_finished_job_alive():
    # The child holds the rank's output pipes; the job used to end only when the child did (58-114 s).
    returncode, stdout, stderr, seconds = run_plain_job("start-a-child", timeout=50)
    assert returncode == 0, stderr
    assert seconds < 15
    assert "rank 0 done" in stdout and "rank 1 done" in stdout
    assert "a process a rank started still held the ranks' output open" in stderr, stderr


def _start_running_ranks(marker):
    launcher = start("-n", "2", "--no-gpu", "--", str(PLAIN), "run-forever", marker, stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE)
    running = 0
    for line in launcher.stderr:
        running += line.endswith(": running\n")
        if running == 2:
            return launcher
    raise AssertionError(f"the ranks did not start: exit {launcher.wait()}")


def test_killing_only_the_launcher_stops_every_rank_within_10_s():
    marker = f"marker-{uuid.uuid4().hex}"
    launcher = _start_running_ranks(marker)
    try:
        os.kill(launcher.pid, signal.SIGKILL)  # only the command: the ranks are in another session
        launcher.wait(timeout=10)
        assert wait_until_gone(marker, 10) == []
    finally:
        stop_leftovers(launcher, marker)


def test_sighup_to_the_launcher_stops_every_rank_like_sigterm():
    marker = f"marker-{uuid.uuid4().hex}"
    launcher = _start_running_ranks(marker)
    try:
        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=10) == 128 + signal.SIGHUP
        assert last_line(launcher.stderr.read()) == "tarantella: stopped every rank on SIGHUP."
        assert wait_until_gone(marker, 10) == []
    finally:
        stop_leftovers(launcher, marker)


def test_a_host_that_never_answers_ends_the_start_up_after_the_bound_naming_it(tmp_path):
    marker = f"hung-ssh-{uuid.uuid4().hex}"
    hung_ssh = tmp_path / marker
    hung_ssh.write_text(textwrap.dedent("""\
        #!/bin/sh
        # An ssh to a host that does not answer: it hangs.
        exec sleep 600
        """))
    hung_ssh.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{socket.gethostname()}\nunreachable-node\n")
    started = time.monotonic()
    launcher = start("--hostfile", str(hostfile), "--no-gpu", "--", str(PLAIN), "run-forever", marker,
                     env={"TNT_START_TIMEOUT": "3", "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(hung_ssh)},
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = launcher.communicate(timeout=30)
        ended = time.monotonic()
        leftovers = wait_until_gone(marker, 5)  # the hung ssh too
    finally:
        stop_leftovers(launcher, marker)
    assert launcher.returncode == 1, stderr
    assert ended - started < 12
    assert last_line(stderr).startswith("tarantella: the job failed (exit status 1): only 1 of 2 ranks started "
                                        "within 3 s (TNT_START_TIMEOUT); hosts that never joined: "
                                        "unreachable-node."), stderr
    assert leftovers == []
