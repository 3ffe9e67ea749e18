"""Processes a rank's program started and left running: found when the rank ends, and ended after a short grace.

A batch system ends every process of a job step; a rank of the `tarantella` command does the same for
what its program started (a TensorBoard server, a log shipper, a `Popen` nobody waited for), also
where such a process made a process group or session of its own or forked twice to leave its parent.
Standard library only: the rank's entry runs it before and after the program, without tarantella.
"""

import ctypes
import os
import signal
import time

GRACE_S = 3.0  # how long processes get to end after SIGTERM, before SIGKILL
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def adopt_orphans():
    """Makes this process inherit the orphans of its descendants (a daemon that forked twice) instead
    of init, so that `left_running` finds them. Linux only; elsewhere nothing changes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def left_running(pid=None):
    """The live descendants of `pid` (default: this process), nearest first, as (pid, command line)."""
    pid = os.getpid() if pid is None else pid
    children = {}
    for child, parent in _live_processes():
        children.setdefault(parent, []).append(child)
    found, queue = [], [pid]
    while queue:
        for child in sorted(children.get(queue.pop(0), [])):
            found.append((child, _command_line(child)))
            queue.append(child)
    return found


def end(pids, grace_s=GRACE_S):
    """Sends SIGTERM to each of `pids`, then SIGKILL to those still alive after `grace_s`, reaping
    this process's own children as they end. Returns the pids that needed SIGKILL."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        _reap_children()
        alive = [pid for pid in alive if _is_alive(pid)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    _reap_children()
    return alive


def _live_processes():
    """(pid, parent pid) of every process that has not ended (zombies left out)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        if fields[0] not in ("Z", "X"):
            yield int(entry), int(fields[1])


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            words = file.read().split(b"\0")
    except OSError:
        return "?"
    return " ".join(word.decode(errors="replace") for word in words if word) or "?"


def _is_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _reap_children():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
