"""Running a job: the MPI launcher in a process group of its own, watched by the output monitor;
the command's signals forwarded to it; stopping it; and the command's last line, which says how
the job ended."""

import os
import secrets
import signal
import subprocess
import threading
import time

from tarantella.common import config
from tarantella.common.child_processes import end_with_parent
from tarantella.common.rank_entry import REPORT_KEY_OPTION
from tarantella.launcher.job_command import RANK_ENTRY
from tarantella.launcher.messages import say
from tarantella.launcher.output_monitor import FAILURE_GRACE_S, OutputMonitor

_STOP_GRACE_S = 3.0  # the MPI launcher gets this long to stop its ranks before everything is killed


def run(command, environment, ranks, hosts, start_timeout_s, mpi):
    """Runs the MPI launcher `mpi` with `command`; `ranks` is how many ranks announce their start
    (0: none do). Returns the command's exit status."""
    env = dict(os.environ)
    env.update(environment)
    # Made up for this job and handed to the ranks on their command line (which every MPI
    # launcher passes on as it is): only the ranks' own reports carry it.
    report_key = secrets.token_hex(16)
    if RANK_ENTRY in command:
        at = command.index(RANK_ENTRY) + 1
        command = command[:at] + [REPORT_KEY_OPTION + report_key] + command[at:]
    # Its own process group: the command stops it and all it started (ssh included) at once.
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, preexec_fn=end_with_parent)

    interrupted = []
    save_signal = config.save_on_signal()
    save_requested = []
    monitor = OutputMonitor(report_key, child.pid, mpi, hosts, quiet_tensorflow=not config.tensorflow_startup_logs())

    def forward(signum, _frame):
        if signum == save_signal and not save_requested:
            # One rank that knows suffices: the request rides in the ranks' next agreement message,
            # so every rank stops at the same step. A second such signal stops the job at once.
            save_requested.append(signum)
            monitor.signal_ranks_here(signum)
            return
        interrupted.append(signum)
        # SIGTERM, not SIGINT: each rank would print a KeyboardInterrupt traceback. The MPI
        # launcher stops every rank on every host.
        _signal_quietly(child.pid, signal.SIGTERM)

    for signum in {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} | ({save_signal} - {None}):
        signal.signal(signum, forward)
    pumps = [threading.Thread(target=monitor.pass_on_stdout, args=(child.stdout,), daemon=True),
             threading.Thread(target=monitor.pass_on_stderr, args=(child.stderr,), daemon=True)]
    for pump in pumps:
        pump.start()
    started_at = time.monotonic()
    stopped_because = None
    interrupted_at = None
    while True:
        try:
            status = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if interrupted:
            # An MPI launcher that lost a proxy may ignore SIGTERM; the command must still end.
            interrupted_at = interrupted_at or now
            if now - interrupted_at > _STOP_GRACE_S:
                _signal_quietly(child.pid, signal.SIGKILL, group=True)
            continue
        if stopped_because:
            continue
        if ranks and len(monitor.started) < ranks and now - started_at > start_timeout_s:
            stopped_because = monitor.start_failure(ranks, start_timeout_s)
        elif monitor.failed and now - monitor.failed[0].at > FAILURE_GRACE_S:
            stopped_because = "failure"  # e.g. a rank failed before MPI started: the others wait in MPI
        elif monitor.proxy_loss_settled(now):
            stopped_because = "failure"  # the MPI launcher may wait for the lost proxy for ever
        elif ranks and monitor.every_rank_ended(ranks, now):
            stopped_because = "finished"
        if stopped_because:
            _stop(child)
    monitor.stop_ranks_left_here()  # e.g. ranks whose proxy and MPI launcher were killed
    for pump in pumps:
        pump.join(timeout=5)
    if interrupted:
        return _report(f"stopped every rank on {signal.Signals(interrupted[0]).name}.", 128 + interrupted[0])
    if monitor.saved and status == 0 and not stopped_because:
        return _report(f"{monitor.saved}; every rank stopped. The same command resumes from there (exit status "
                       f"{config.SAVED_AND_STOPPED_STATUS}).", config.SAVED_AND_STOPPED_STATUS)
    if save_requested and status == 0 and not stopped_because:
        say(f"tarantella: WARNING: the job ended on its own after {signal.Signals(save_requested[0]).name} asked it to "
            "save and stop, before a training step came: no backup was written then.")
    if stopped_because == "finished":
        say("tarantella: WARNING: every rank finished, but a process a rank started still held the ranks' "
             "output open, so the MPI launcher was stopped. Wait for the processes your program starts "
             "(e.g. subprocess.run, or Popen(...).wait()) if their output matters.")
        return 0
    if stopped_because and stopped_because != "failure":
        return _report(f"the job failed (exit status 1): {stopped_because}", 1)
    if status == 0 and not stopped_because:
        early = monitor.ranks_that_left_early()
        if not early:
            return 0
        return _report(f"the job failed (exit status 1): {early}", 1)
    code = 1 if stopped_because or status == 0 else 128 - status if status < 0 else status
    refusal = monitor.launcher_refusal() if status > 0 and not stopped_because else None
    if refusal:
        return _report(refusal, code)
    killed_by = _signal_name(-status) if status < 0 and not stopped_because else None
    return _report(f"the job failed (exit status {code}): {monitor.failure(status, killed_by)}", code)


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _signal_quietly(pid, signum, group=False):
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(child):
    """Stops the MPI launcher, then whatever of its process group still runs."""
    _signal_quietly(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_quietly(child.pid, signal.SIGKILL, group=True)


def _report(message, code):
    say(f"tarantella: {message}")
    return code
