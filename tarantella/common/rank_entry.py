"""What each rank started by the `tarantella` command runs:
`python rank_entry.py --report-key=KEY program ...`.

It runs the program as `python -m mpi4py` does (an uncaught error or a non-zero exit ends
the whole job through MPI_Abort), and reports to the command on stderr when the rank started,
finished the program, or failed (with the error, and the rank that caused it when the error
is a consequence of another rank's failure). So the command can bound the start-up, end a job
whose rank failed before MPI started (the others would wait in MPI's start-up for ever), tell
a rank that vanished with status 0 (`os._exit(0)`) from one that finished, and name the rank
whose failure came first.

Every report carries KEY, which the command makes up for each job: a line the program prints
(an old log, a copy of another job's output) cannot pass for a report. The key is taken out
of the program's arguments before it runs.

When the program ends, the processes it started and left running are ended, after a short
grace, with one line naming them (common/left_processes.py; TNT_KEEP_CHILD_PROCESSES=true keeps
them).

It is run as a file, not as `-m tarantella....`: importing the tarantella package would
start MPI and TensorFlow before the program's first line; the modules of `tarantella.common` it
uses are loaded from their files (they need the standard library only).
"""

import importlib.util
import os
import signal
import socket
import sys
import threading
import time

# Every report starts so, followed at once by the job's key; the launcher imports these names.
RANK_ANNOUNCEMENT = "tarantella-rank-announcement:"
REPORT_KEY_OPTION = "--report-key="
STARTED, FINISHED, FAILED, SAVED = "started", "finished", "failed", "saved"
# The culprit field of a failure report: the rank's own failure, or one seen in a broken MPI
# call whose cause MPI does not tell; otherwise the number of the rank that caused it.
OWN_FAILURE, UNKNOWN_CULPRIT = "-", "?"
_OUTPUT_GRACE_S = 1.0
_PARENT_CHECK_S = 0.5
_ORPHAN_GRACE_S = 1.0
# Where MPI launchers put the rank before MPI starts: Hydra, Open MPI, PMIx, Slurm.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
PARENT_WATCH_THREAD = "tarantella-parent-watch"
# Set by tarantella's runtime once it runs in this rank (this module imports nothing of tarantella):
# the CollectiveError behind an error, if any, and how to tell the other ranks this one fails.
unwrap_failure = None
tell_other_ranks = None

_report_key = None  # this job's key; None where the `tarantella` command did not start the rank
warning_received = False  # the cluster's warning signal came before tarantella listened for it
_failure_reported = False


def launcher_rank():
    return next((os.environ[name] for name in _RANK_VARIABLES if os.environ.get(name)), "?")


def reports_to_the_command():
    return bool(_report_key)


def announce(event, *details):
    global _failure_reported
    if _report_key is None:
        return
    _failure_reported = _failure_reported or event == FAILED
    line = " ".join([RANK_ANNOUNCEMENT + _report_key, event, launcher_rank(), socket.gethostname(),
                     str(os.getpid()), *details])
    write_to_process_stderr(" ".join(line.split()))  # one line, whatever a summary holds


def write_to_process_stderr(line):
    """Writes `line` to the process's standard error itself (file descriptor 2), which the
    `tarantella` command reads, not to `sys.stderr`: a program may replace that (e.g. with
    os.devnull, to hide TensorFlow's warnings), and the command would miss the line."""
    for stream in (sys.stderr, sys.__stderr__):  # what the program wrote before comes first
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.write(2, (line + "\n").encode())
    except OSError:  # closed: nobody can read it
        pass


def describe_failure(error):
    """(error name, culprit field, one-line summary or "") for the report of an uncaught `error`."""
    if unwrap_failure is not None:  # TensorFlow wraps tarantella's errors raised inside a step
        error = unwrap_failure(error) or error
    culprit = getattr(error, "culprit", None)
    mpi = sys.modules.get("mpi4py.MPI")
    if culprit is None and mpi is not None and isinstance(error, mpi.Exception):
        culprit = UNKNOWN_CULPRIT  # a broken MPI call: another rank's failure, most likely
    summary = getattr(error, "summary", None) or ""
    return type(error).__name__, OWN_FAILURE if culprit is None else str(culprit), " ".join(summary.split())


def report_mpi_abort(status):
    """Reports that the program calls MPI_Abort, unless this rank reported its failure already:
    the MPI launcher kills the other ranks while this one waits, and may drop the MPI
    library's own message, so only this report can name the rank."""
    if reports_to_the_command() and not _failure_reported:
        announce(FAILED, f"mpi-abort-{status}", OWN_FAILURE)
        time.sleep(_OUTPUT_GRACE_S)  # MPI stops passing on this rank's output once it aborts


def watch_parent():
    """Ends this rank when its parent, the MPI launcher's proxy on this host, is gone (killed, or
    its ssh connection dropped): MPI could no longer end the rank, which would run on for ever.
    Tells the other ranks first (when tarantella runs here), so that they fail naming this one."""
    if any(thread.name == PARENT_WATCH_THREAD for thread in threading.enumerate()):
        return
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm") as file:
            parent_name = file.read().strip()
    except OSError:
        parent_name = "the MPI launcher's proxy"

    def watch():
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        summary = (f"rank {launcher_rank()} on host {socket.gethostname()} lost its MPI proxy ({parent_name}, pid "
                   f"{parent}): it ended (killed, or its ssh connection dropped), so this rank stopped")
        write_to_process_stderr(f"tarantella: {summary}.")
        if tell_other_ranks is not None:
            tell_other_ranks(summary)
        # A moment longer: the `tarantella` command tells ranks that outlive their proxy from
        # ranks their proxy killed as it ended.
        time.sleep(_ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name=PARENT_WATCH_THREAD, daemon=True).start()


def _common_module(name):
    """tarantella.common.`name`, loaded from its file beside this one without importing the package,
    and registered under its name, so that tarantella uses this very module once imported."""
    full_name = f"tarantella.common.{name}"
    if full_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(full_name, os.path.join(os.path.dirname(__file__), name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full_name] = module
        spec.loader.exec_module(module)
    return sys.modules[full_name]


def hear_the_warning_early():
    """With TNT_SAVE_ON_SIGNAL, the cluster's warning may come before the program imports tarantella,
    whose listener (runtime/stop_request.py) then takes the request over: until then it is noted
    here (`warning_received`), so that the rank does not die of the signal's default action. Called
    before the rank announces its start, so that the command passes the signal on to no rank that
    would."""
    try:
        signum = _common_module("config").save_on_signal()
    except ValueError:  # checked by the command already; tarantella says so once imported
        return
    if signum is not None:
        signal.signal(signum, _note_the_warning)


def _note_the_warning(_signum, _frame):
    global warning_received
    warning_received = True


def end_left_processes():
    """Ends the processes the program left running, naming them in one line, unless the
    settings keep them."""
    config, left_processes = _common_module("config"), _common_module("left_processes")
    try:
        if config.keep_child_processes():
            return
    except ValueError as error:  # checked by the command already; a rank started by hand says so here
        write_to_process_stderr(f"tarantella: {error}")
        return
    left = left_processes.left_running()
    if not left:
        return
    listing = ", ".join(f"pid {pid} ({command[:200]})" for pid, command in left)
    write_to_process_stderr(
        f"tarantella: rank {launcher_rank()} on host {socket.gethostname()}: the program left {len(left)} "
        f"process{'es' * (len(left) > 1)} running, ended now: {listing}. TNT_KEEP_CHILD_PROCESSES=true keeps them.")
    left_processes.end([pid for pid, _ in left])


def main():
    global _report_key
    # Run as a file, Python put this file's folder first on the path, where tarantella's modules
    # would hide the program's own (data.py, config.py, ...). The program's folder goes there.
    sys.path[0] = os.getcwd()
    # tarantella, once the program imports it, reports through this module, which holds the key.
    sys.modules["tarantella.common.rank_entry"] = sys.modules[__name__]
    _common_module("left_processes").adopt_orphans()
    hear_the_warning_early()
    arguments = sys.argv[1:]
    if arguments and arguments[0].startswith(REPORT_KEY_OPTION):
        _report_key = arguments.pop(0)[len(REPORT_KEY_OPTION):]
    else:  # started by hand: reports that no command reads
        _report_key = ""
    from mpi4py.run import run_command_line, set_abort_status

    announce(STARTED, str(os.getppid()))
    watch_parent()
    try:
        run_command_line(arguments)
    except SystemExit as exit:
        status = exit.code
        if status in (None, 0):
            end_left_processes()
            announce(FINISHED)
        else:
            status = status if isinstance(status, int) else 1
            announce(FAILED, f"exit-status-{status}", OWN_FAILURE)
            end_left_processes()
            _abort_at_once(status)
        set_abort_status(exit)
        raise
    except KeyboardInterrupt as interrupt:
        end_left_processes()
        set_abort_status(interrupt)
        raise
    except BaseException as error:
        announce(FAILED, *describe_failure(error))  # first: the command names the rank that failed first
        end_left_processes()
        set_abort_status(1)
        raise
    end_left_processes()
    announce(FINISHED)


def _abort_at_once(status):
    """Ends the job now: at exit, tarantella would first tell the other ranks this one finished."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # The MPI launcher stops passing on this rank's output once it aborts; the announcement
        # above (the `tarantella` command names the rank with it) needs a moment to get out.
        time.sleep(_OUTPUT_GRACE_S)
        mpi.COMM_WORLD.Abort(status)


if __name__ == "__main__":
    main()
