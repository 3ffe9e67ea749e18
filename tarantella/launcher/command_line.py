"""The `tarantella` command's options, and the checks of the program it is to run."""

import argparse
import os
import shlex
import shutil

from tarantella import __version__
from tarantella.launcher import restarts
from tarantella.launcher.messages import LaunchError

USAGE = "tarantella [options] -- program.py [program arguments ...]"


def parse(argv):
    """(the options, the program and its arguments) of the command line `argv`."""
    if "--" in argv:
        split = argv.index("--")
        own, program = argv[:split], argv[split + 1:]
    else:
        own, program = argv, []
    parser = build_parser()
    options, unknown = parser.parse_known_args(own)
    if unknown:
        if "--" not in argv and not unknown[0].startswith("-"):
            parser.error(f"put the program after '--': tarantella {shlex.join(own[:len(own) - len(unknown)])}"
                         f"{' ' if len(own) > len(unknown) else ''}-- {shlex.join(unknown)}")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for assignment in options.variables:
        if "=" not in assignment or assignment.startswith("="):
            parser.error(f"-x expects VAR=VALUE, got {assignment!r}")
    if options.force and not options.cleanup:
        parser.error("--force only goes with --cleanup, e.g. tarantella --cleanup --force -- train.py")
    if not program:
        parser.error("name the program after '--', e.g. tarantella -n 2 -- train.py")
    restarts.check_options(parser, options)
    return options, program


def build_parser():
    """The `tarantella` command's argument parser (the documentation's command reference is made from it)."""
    parser = argparse.ArgumentParser(
        prog="tarantella", usage=USAGE,
        description="Run a Keras program that uses tarantella on several ranks (processes), on this "
                    "node, on the hosts of a hostfile, or in a Slurm allocation.")
    parser.add_argument("-n", dest="ranks", type=_positive_int, metavar="N",
                        help="number of ranks in all (default: one per GPU of each node, or one per node "
                             "without GPUs)")
    parser.add_argument("--hostfile", metavar="FILE",
                        help="run on these hosts: one unique host name per line (default: this node, or "
                             "the nodes of the Slurm allocation)")
    parser.add_argument("--n-per-node", "--devices-per-node", "--npernode", dest="n_per_node",
                        type=_positive_int, metavar="N", help="ranks on each node")
    parser.add_argument("--no-gpu", action="store_true",
                        help="run every rank on CPU, even where GPUs exist (and do not warn about GPUs)")
    parser.add_argument("-x", dest="variables", action="extend", nargs="+", default=[],
                        metavar="VAR=VALUE", help="set an environment variable on every rank; repeatable, "
                                                  "order kept")
    parser.add_argument("--fusion-threshold", type=_kilobytes, metavar="KB",
                        help="smallest fused gradient allreduce in kilobytes (default: 32 on one node, across "
                             "nodes 512 per rank up to 16384; 0 = no fusion)")
    parser.add_argument("--timeline", metavar="FILE",
                        help="write a trace of every rank's steps and collectives to FILE (Chrome trace-event "
                             "JSON: Perfetto, chrome://tracing), and print a step report per rank after fit")
    parser.add_argument("--output-on-all-devices", action="store_true",
                        help="show Keras output (progress bars, callback messages) of every rank, "
                             "not only the master's")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="tarantella's log level (default WARNING)")
    parser.add_argument("--log-on-all-devices", action="store_true",
                        help="log on every rank, each line tagged with its rank (default: master only)")
    parser.add_argument("--pin-to-socket", action="store_true",
                        help="bind each rank of a node to its own NUMA node (socket) with numactl; memory "
                             "comes preferably from that socket")
    parser.add_argument("--pin-memory-to-socket", action="store_true",
                        help="allocate each rank's memory only on its own NUMA node (numactl --membind)")
    parser.add_argument("--python-interpreter", metavar="CMD",
                        help="command that runs the program, e.g. 'valgrind --tool=memcheck python'; "
                             "'' runs the program itself (a binary). Default: this Python for .py files")
    parser.add_argument("--cleanup", action="store_true",
                        help="stop the processes of yours that run the named program, on every host, "
                             "and exit")
    parser.add_argument("--force", action="store_true",
                        help="with --cleanup: kill at once (SIGKILL) instead of asking to stop (SIGTERM)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and environment that would run, and exit")
    parser.add_argument("--version", action="version", version=f"tarantella {__version__}")
    restarts.add_options(parser)
    return parser


def check_program(options, program):
    """A missing script is reported once here, not as a traceback on every rank."""
    runs_python_file = program[0].endswith(".py") and options.python_interpreter != ""
    if runs_python_file and not options.dry_run and not os.path.isfile(program[0]):
        raise LaunchError(f"the program {program[0]!r} does not exist (in {os.getcwd()}). Name the script to "
                          "run after '--', e.g. tarantella -n 2 -- train.py.")


def check_interpreter_here(options, hosts):
    """A --python-interpreter that cannot run on this node, where every rank runs, is reported here:
    Intel MPI's mpiexec often dies of SIGPIPE (status 141) before it passes on its proxy's error."""
    if hosts or not options.python_interpreter or options.dry_run:
        return
    interpreter = shlex.split(options.python_interpreter)[0]
    if not shutil.which(interpreter):
        raise LaunchError(f"the interpreter {interpreter!r} (--python-interpreter) is not an executable program "
                          "(nor on PATH). Name one that exists on every host at the same path.")


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
