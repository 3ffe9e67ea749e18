"""What each rank started by the `tarantella` command runs: `python rank_entry.py program ...`.

It runs the program as `python -m mpi4py` does (an uncaught error or a non-zero exit ends
the whole job through MPI_Abort), and tells the command on stderr when the rank started,
finished the program, or failed. So the command can bound the start-up, end a job whose
rank failed before MPI started (the others would wait in MPI's start-up for ever), and tell
a rank that vanished with status 0 (`os._exit(0)`) from one that finished.

It is run as a file, not as `-m tarantella....`: importing the tarantella package would
start MPI and TensorFlow before the program's first line.
"""

import os
import socket
import sys
import time

# Every line the command keeps to itself starts so; the launcher imports these names.
RANK_ANNOUNCEMENT = "tarantella-rank-announcement:"
STARTED, FINISHED, FAILED = "started", "finished", "failed"
_OUTPUT_GRACE_S = 1.0
# Where MPI launchers put the rank before MPI starts: Hydra, Open MPI, PMIx, Slurm.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def announce(event, *details):
    rank = next((os.environ[name] for name in _RANK_VARIABLES if os.environ.get(name)), "?")
    write_to_process_stderr(" ".join([RANK_ANNOUNCEMENT, event, rank, socket.gethostname(), str(os.getpid()),
                                      *details]))


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


def main():
    # Run as a file, Python put this file's folder first on the path, where tarantella's modules
    # would hide the program's own (data.py, config.py, ...). The program's folder goes there.
    sys.path[0] = os.getcwd()
    from mpi4py.run import run_command_line, set_abort_status

    announce(STARTED)
    try:
        run_command_line(sys.argv[1:])
    except SystemExit as exit:
        status = exit.code
        if status in (None, 0):
            announce(FINISHED)
        else:
            status = status if isinstance(status, int) else 1
            announce(FAILED, f"exit-status-{status}")
            _abort_at_once(status)
        set_abort_status(exit)
        raise
    except KeyboardInterrupt as interrupt:
        set_abort_status(interrupt)
        raise
    except BaseException as error:
        announce(FAILED, type(error).__name__)
        set_abort_status(1)
        raise
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
