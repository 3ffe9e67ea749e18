"""Ranks that use MPI but not tarantella (nor TensorFlow), so they start in a fraction of a
second: for the launcher's own fault handling. `plain_ranks.py NAME` runs one."""

import os
import sys
import time


def fail_before_mpi():
    """Rank 1 fails before MPI starts (a missing data file); rank 0 waits in MPI's start-up."""
    if os.environ.get("PMI_RANK") == "1":
        sys.stderr.write(f"rank 1: failing at {time.time():.3f}\n")
        sys.stderr.flush()
        open("/nonexistent/tarantella-test-data.npz")
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()


def chatter():
    """Lots of output from every rank, then both finish together."""
    from mpi4py import MPI
    for number in range(20000):
        sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()} line {number} {'x' * 60}\n")
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    sys.stderr.write(f"rank {MPI.COMM_WORLD.Get_rank()}: finished\n")


def start_a_child(marker):
    """Each rank starts a long command it does not wait for (it inherits the rank's output), then finishes."""
    import subprocess
    from mpi4py import MPI
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    MPI.COMM_WORLD.Barrier()
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()} done\n")


def leave_helpers_running(marker):
    """Rank 0 starts a helper in a session of its own, rank 1 one that forks twice to leave it (as a
    daemon does) and one that ignores SIGTERM; both finish without waiting for them."""
    import subprocess
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    if rank == 0:
        subprocess.Popen(sleeper, start_new_session=True)
    else:
        daemon = ("import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)")
        subprocess.run([sys.executable, "-c", daemon, *sleeper], check=True)
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", stubborn, marker])
    time.sleep(0.5)  # the helpers are running
    MPI.COMM_WORLD.Barrier()
    sys.stdout.write(f"rank {rank} done\n")


def run_forever(ignore_sigterm=False):
    if ignore_sigterm:  # a program that blocks SIGTERM (or whose handler does not end it)
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mpi4py import MPI
    sys.stderr.write(f"rank {MPI.COMM_WORLD.Get_rank()}: running\n")
    sys.stderr.flush()
    while True:
        time.sleep(0.1)


def old_failure_lines_then_rank_1_raises():
    """Rank 0 prints what looks like failure reports (a log of an earlier job), then rank 1 fails."""
    import socket
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        host = socket.gethostname()
        sys.stderr.write(f"tarantella: rank 0 on host {host} failed with ValueError; stopping all ranks.\n"
                         f"tarantella-rank-announcement: failed 0 {host} {os.getpid()} ValueError - old\n"
                         f"tarantella-rank-announcement:0123456789abcdef0123456789abcdef failed 0 {host} "
                         f"{os.getpid()} ValueError - old\n")
        sys.stderr.flush()
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 1:
        sys.stderr.write(f"rank 1: failing at {time.time():.3f}\n")
        sys.stderr.flush()
        raise RuntimeError("the real failure")
    while True:
        time.sleep(0.1)


def fail_on_attempts(attempts):
    """Rank 1 raises on the listed restart attempts (e.g. "0,1"), fails before MPI starts on those
    listed with a "startup" prefix ("startup1"), and otherwise both ranks finish."""
    attempt = os.environ.get("TNT_RESTART_ATTEMPT", "0")
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    if rank == "1" and f"startup{attempt}" in attempts.split(","):
        open("/nonexistent/tarantella-test-data.npz")
    from mpi4py import MPI
    if rank == "1" and attempt in attempts.split(","):
        raise RuntimeError(f"failure on attempt {attempt}")
    MPI.COMM_WORLD.Barrier()
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()} attempt {attempt} done\n")


if __name__ == "__main__":
    if sys.argv[1] == "start-a-child":
        start_a_child(sys.argv[2])
    elif sys.argv[1] == "leave-helpers-running":
        leave_helpers_running(sys.argv[2])
    elif sys.argv[1] == "fail-on-attempts":
        fail_on_attempts(sys.argv[2])
    else:
        {"fail-before-mpi": fail_before_mpi, "chatter": chatter, "run-forever": run_forever,
         "run-forever-ignoring-sigterm": lambda: run_forever(ignore_sigterm=True),
         "old-failure-lines-then-rank-1-raises": old_failure_lines_then_rank_1_raises}[sys.argv[1]]()
