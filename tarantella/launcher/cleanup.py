"""`tarantella --cleanup`: stops the user's processes that run the named program, on this node or,
through the MPI launcher, on every host of the job."""

import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from tarantella.launcher import mpis

# The first argument of the helper that the MPI launcher runs on each host.
STOP_HERE = "_stop-processes-here"
_GRACE_S = 5.0


def cleanup(options, program, hosts):
    signal_name = "SIGKILL" if options.force else "SIGTERM"
    if not hosts:
        if options.dry_run:
            print(f"would send {signal_name} to your processes on this node whose command line names "
                  f"{os.path.basename(program[0])}")
            return 0
        return stop_processes_here(signal_name, program[0])
    mpi = mpis.identify(mpis.find_mpiexec())
    command = mpi.one_process_per_host(hosts) + [sys.executable, "-m", "tarantella.launcher", STOP_HERE,
                                                  signal_name, program[0]]
    if options.dry_run:
        print("command:\n  " + shlex.join(command))
        return 0
    return subprocess.run(command).returncode


def stop_processes_here(signal_name, program):
    """Signals this user's processes whose command line names `program`, except this one's ancestors."""
    name = os.path.basename(program)
    spared = _ancestors()
    matching = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                arguments = file.read().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        # Other hosts' helpers of the same cleanup are spared (hosts that share /proc see them).
        if STOP_HERE not in arguments and any(os.path.basename(argument) == name for argument in arguments):
            matching.append(int(entry))
    for pid in matching:
        try:
            os.kill(pid, getattr(signal, signal_name))
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _GRACE_S
    alive = matching
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _running(pid)]
    host = socket.gethostname()
    # One write: the helpers of several hosts share the launcher's output, line by line.
    sys.stdout.write(f"tarantella: {host}: sent {signal_name} to {len(matching)} process(es) running {name}"
                     + (f"; still running: {alive}. Try --force.\n" if alive else ".\n"))
    sys.stdout.flush()
    return 1 if alive else 0


def _ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as file:
                pid = int(file.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return pids


def _running(pid):
    """True until the process has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
