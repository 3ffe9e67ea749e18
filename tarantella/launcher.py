"""The `tarantella` command: runs a program as N ranks through the MPI launcher in use.

It imports neither TensorFlow nor MPI, so `tarantella --help` and `--dry-run` answer at once.
"""

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys

from tarantella import __version__

USAGE = "tarantella [options] -- program.py [program arguments ...]"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    options, program = _parse(argv)
    mpiexec = _find_mpiexec()
    command, environment = build_command(options, program, mpiexec, _mpi_flavour(mpiexec))
    if options.dry_run:
        print("command:")
        print("  " + shlex.join(command))
        print("environment (added for every rank, in this order):")
        for name, value in environment:
            print(f"  {name}={value}")
        return 0
    return _run(command, environment)


def _parse(argv):
    if "--" in argv:
        split = argv.index("--")
        own, program = argv[:split], argv[split + 1:]
    else:
        own, program = argv, []
    parser = argparse.ArgumentParser(
        prog="tarantella", usage=USAGE,
        description="Run a Keras program that uses tarantella on several ranks (processes).")
    parser.add_argument("-n", dest="ranks", type=_positive_int, default=1, metavar="N",
                        help="number of ranks to start on this node (default 1)")
    parser.add_argument("-x", dest="variables", action="extend", nargs="+", default=[],
                        metavar="VAR=VALUE", help="set an environment variable on every rank; repeatable, "
                                                  "order kept")
    parser.add_argument("--fusion-threshold", type=_kilobytes, metavar="KB",
                        help="smallest fused gradient allreduce in kilobytes (default 32; 0 = no fusion)")
    parser.add_argument("--output-on-all-devices", action="store_true",
                        help="show Keras output (progress bars, callback messages) of every rank, "
                             "not only the master's")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="tarantella's log level (default WARNING)")
    parser.add_argument("--log-on-all-devices", action="store_true",
                        help="log on every rank, each line tagged with its rank (default: master only)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and environment that would run, and exit")
    parser.add_argument("--version", action="version", version=f"tarantella {__version__}")
    options = parser.parse_args(own)
    for assignment in options.variables:
        if "=" not in assignment or assignment.startswith("="):
            parser.error(f"-x expects VAR=VALUE, got {assignment!r}")
    if not program:
        parser.error("name the program after '--', e.g. tarantella -n 2 -- train.py")
    return options, program


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects a whole number of ranks >= 1, got {text!r}")
    return value


def _kilobytes(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expects a number of kilobytes >= 0, got {text!r}")
    return text


def build_command(options, program, mpiexec, flavour):
    """The mpiexec command line and the variables it hands to every rank."""
    environment = [("PYTHONUNBUFFERED", "1")]
    if options.fusion_threshold is not None:
        environment.append(("TNT_FUSION_THRESHOLD", options.fusion_threshold))
    if options.output_on_all_devices:
        environment.append(("TNT_OUTPUT_ON_ALL_DEVICES", "true"))
    if options.log_level:
        environment.append(("TNT_LOG_LEVEL", options.log_level))
    if options.log_on_all_devices:
        environment.append(("TNT_LOG_ON_ALL_DEVICES", "true"))
    environment += [tuple(assignment.split("=", 1)) for assignment in options.variables]

    command = list(mpiexec) + ["-n", str(options.ranks)]
    for name, value in environment:
        if flavour == "hydra":
            command += ["-genv", name, value]
        elif flavour == "openmpi":
            command += ["-x", f"{name}={value}"]
    runs_python = program[0].endswith(".py")
    return command + ([sys.executable] if runs_python else []) + program, environment


def _find_mpiexec():
    configured = os.environ.get("TNT_MPIEXEC")
    if configured:
        return shlex.split(configured)
    # The `mpich` wheel installs mpiexec beside the interpreter, which need not be on PATH.
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside_python, os.X_OK):
        return [beside_python]
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found:
        return [found]
    sys.exit("tarantella: no mpiexec found. Install an MPI (e.g. pip install 'tarantella[mpich]'), put "
             "your MPI's bin directory on PATH, or name the launcher with TNT_MPIEXEC.")


def _mpi_flavour(mpiexec):
    """'hydra' (MPICH, Intel MPI, MVAPICH), 'openmpi', or 'unknown' (variables then go by inheritance)."""
    try:
        banner = subprocess.run(list(mpiexec) + ["--version"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in banner or "Intel(R) MPI" in banner:
        return "hydra"
    if "Open MPI" in banner or "OpenRTE" in banner or "prterun" in banner:
        return "openmpi"
    return "unknown"


def _run(command, environment):
    env = dict(os.environ)
    env.update(environment)
    child = subprocess.Popen(command, env=env)

    def forward(signum, _frame):
        child.send_signal(signum)  # mpiexec stops every rank

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    status = child.wait()
    if status != 0:
        code = 128 - status if status < 0 else status
        sys.stderr.write(f"tarantella: the job failed (exit status {code}); the failing rank reported "
                         "above.\n")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
