"""The `tarantella` command: runs a program as ranks on this node, the hosts of a hostfile,
or a Slurm allocation, through the MPI launcher in use (Hydra's mpiexec, Open MPI's mpirun,
or srun).

It imports neither TensorFlow nor MPI, so `tarantella --help` and `--dry-run` answer at once.
"""

import argparse
import functools
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tarantella import __version__, config, restarts
from tarantella.rank_entry import (FAILED, FINISHED, OWN_FAILURE, RANK_ANNOUNCEMENT, REPORT_KEY_OPTION, STARTED,
                                   UNKNOWN_CULPRIT)

USAGE = "tarantella [options] -- program.py [program arguments ...]"
# Variables every rank on every host gets from the launcher's environment (Open MPI, unlike
# Hydra, passes almost nothing on by itself).
# TensorFlow's variables by their documented prefixes, not every TF_ (Terraform uses TF_ too).
FORWARDED_PREFIXES = ("TNT_", "KERAS_", "MPI4PY_", "TF_CPP_", "TF_ENABLE_", "TF_FORCE_", "TF_GPU_", "TF_XLA_",
                      "TF_NUM_", "TF_CUDNN_", "TF_DETERMINISTIC_", "TF_USE_LEGACY_KERAS")
FORWARDED_NAMES = ("PYTHONPATH",)
# TensorFlow's C++ start-up messages (INFO lines in absl's format, and absl's banner) ignore
# TF_CPP_MIN_LOG_LEVEL; the command drops them unless TNT_TENSORFLOW_STARTUP_LOGS is true.
_TENSORFLOW_INFO_LINE = re.compile(r"I\d{4} \d+:\d+:\d+(?:\.\d+)?\s+\d+ [\w.]+:\d+\] ")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_CPU_FEATURES_CONTINUATION = "To enable the following instructions:"
# Ranks started by this command report on stderr, with RANK_ANNOUNCEMENT and the job's key
# first, when they start, finish or fail; the command keeps these lines to itself and uses
# them to bound the start-up and to name the rank whose failure came first, and its host.
# Each rank finds its index on the node here, to pick its NUMA node.
LOCAL_RANK_VARIABLE = {"hydra": "MPI_LOCALRANKID", "openmpi": "OMPI_COMM_WORLD_LOCAL_RANK",
                       "srun": "SLURM_LOCALID"}
_CLEANUP_GRACE_S = 5.0
_FAILURE_GRACE_S = 3.0  # after a rank reported its failure, MPI gets this long to end the job itself
_STOP_GRACE_S = 3.0  # the MPI launcher gets this long to stop its ranks before everything is killed
_STOP_HERE = "_stop-processes-here"
# After every rank finished and its process ended, the MPI launcher gets this long to end by itself;
# past it, only a process a rank started (and left running) holds the ranks' output open.
_ENDED_GRACE_S = 2.0
_REMOTE_ENDED_GRACE_S = 10.0  # ranks on other hosts: from their announcement, their end unseen
_PROXY_LOSS_CHECK_S = 0.2  # well within the time a rank that lost its proxy lives on (rank_entry)
_EXITING = 0x4  # PF_EXITING in the flags of /proc/PID/stat: the process is being torn down
# Open MPI's mpirun refuses to run as root (common in containers) unless both are set.
_OPEN_MPI_ROOT_PERMISSION = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
# Internal: what every rank runs first, and what `--cleanup` looks for on each host.
_RANK_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_entry.py")


class LaunchError(Exception):
    """A problem with the command line or this machine, explained with its fix."""


@dataclass
class Placement:
    hosts: list  # empty: this node only
    ranks_per_node: int
    use_gpu: bool
    warnings: list

    @property
    def ranks(self):
        return self.ranks_per_node * max(1, len(self.hosts))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_STOP_HERE]:
        return _stop_processes_here(argv[1], argv[2])
    options, program = _parse(argv)
    if restarts.supervises(options):
        return restarts.main(argv, options)
    try:
        try:
            setting_warnings = config.check_environment()
        except ValueError as error:
            raise LaunchError(str(error)) from None
        hosts = _hosts(options)
        if options.cleanup:
            return _cleanup(options, program, hosts)
        mpiexec = _find_mpiexec()
        flavour = _mpi_flavour(mpiexec)
        placement = place_ranks(options, hosts, count_gpus())
        command, environment = build_command(options, program, placement, mpiexec, flavour)
        _check_program(options, program)
        _check_interpreter_here(options, placement.hosts)
    except LaunchError as error:
        _say(f"tarantella: error: {error}")
        return 2
    if options.log_level != "ERROR":
        for warning in setting_warnings + placement.warnings:
            _say(f"tarantella: WARNING: {warning}")
    if options.log_level in ("INFO", "DEBUG") and (_OPEN_MPI_ROOT_PERMISSION[0] in dict(environment)):
        _say("tarantella: INFO: running as root, so Open MPI's mpirun gets "
             + " ".join(f"{name}=1" for name in _OPEN_MPI_ROOT_PERMISSION))
    if options.dry_run:
        print("command:")
        print("  " + shlex.join(command))
        print("environment (added for every rank, in this order):")
        for name, value in environment:
            print(f"  {name}={value}")
        where = ", ".join(placement.hosts) if placement.hosts else "this node"
        device = "GPU" if placement.use_gpu else "CPU"
        print(f"ranks: {placement.ranks} ({placement.ranks_per_node} per node on {where}, {device})")
        return 0
    ranks_announcing = placement.ranks if _RANK_ENTRY in command else 0
    return _run(command, environment, ranks_announcing, placement.hosts, config.start_timeout_s(), flavour,
                _mpi_name(mpiexec))


# -- the command line ------------------------------------------------------------------------

def _parse(argv):
    if "--" in argv:
        split = argv.index("--")
        own, program = argv[:split], argv[split + 1:]
    else:
        own, program = argv, []
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
                        help="smallest fused gradient allreduce in kilobytes (default 32; 0 = no fusion)")
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


def _check_program(options, program):
    """A missing script is reported once here, not as a traceback on every rank."""
    runs_python_file = program[0].endswith(".py") and options.python_interpreter != ""
    if runs_python_file and not options.dry_run and not os.path.isfile(program[0]):
        raise LaunchError(f"the program {program[0]!r} does not exist (in {os.getcwd()}). Name the script to "
                          "run after '--', e.g. tarantella -n 2 -- train.py.")


def _check_interpreter_here(options, hosts):
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


# -- where the ranks go ------------------------------------------------------------------------

def _hosts(options):
    """The hostfile's hosts, else the Slurm allocation's nodes, else [] (this node)."""
    if options.hostfile:
        return read_hostfile(options.hostfile)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    return expand_slurm_nodelist(nodelist) if nodelist else []


def read_hostfile(path):
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise LaunchError(f"cannot read the hostfile {path!r}: {error.strerror}.") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if len(name.split()) > 1 or ":" in name:
            raise LaunchError(f"{path}, line {number}: {line.strip()!r} is not a host name. Write one host "
                              "name per line and give the ranks per node with --n-per-node.")
        if name in hosts:
            raise LaunchError(f"{path}, line {number}: host {name!r} is listed twice. Name each host once "
                              "and give the ranks per node with --n-per-node.")
        hosts.append(name)
    if not hosts:
        raise LaunchError(f"the hostfile {path!r} names no host. Write one host name per line.")
    return hosts


def expand_slurm_nodelist(nodelist):
    """'node[01-03,07],gpu1' -> ['node01', 'node02', 'node03', 'node07', 'gpu1']."""
    names = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text + number for number in _expand_ranges(ranges, nodelist)] if ranges else [text]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        names += expanded
    return names


def _expand_ranges(ranges, nodelist):
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise LaunchError(f"cannot read the Slurm node list {nodelist!r}; give the hosts with --hostfile.")
        numbers += [str(n).zfill(len(first)) for n in range(int(first), int(last or first) + 1)]
    return numbers


def _slurm_ranks_per_node():
    """Slurm's tasks per node when every node has the same number, else None."""
    if os.environ.get("SLURM_NTASKS_PER_NODE"):
        return int(os.environ["SLURM_NTASKS_PER_NODE"])
    counts = set()
    for entry in os.environ.get("SLURM_TASKS_PER_NODE", "").split(","):  # e.g. "2(x3),2"
        match = re.fullmatch(r"(\d+)(?:\(x\d+\))?", entry)
        if match:
            counts.add(int(match.group(1)))
    if len(counts) > 1:
        # e.g. `sbatch -n 3 -N 2`: running one rank per node instead would leave tasks idle, silently.
        raise LaunchError(f"the Slurm allocation has different numbers of tasks per node (SLURM_TASKS_PER_NODE="
                          f"{os.environ['SLURM_TASKS_PER_NODE']}), and tarantella runs as many ranks on every "
                          "node. Ask Slurm for the same number on each (--ntasks-per-node), or give -n or "
                          "--n-per-node.")
    return counts.pop() if counts else None


# srun's PMI plug-in for each family of MPI launchers: MPICH, Intel MPI and MVAPICH (Hydra) speak PMI-2;
# Open MPI 5 only PMIx (docs/running.md, Slurm).
_SRUN_PMI_PLUGIN = {"hydra": "pmi2", "openmpi": "pmix"}


def srun_pmi_option(srun):
    """srun's `--mpi=PLUGIN` for the MPI that mpi4py loads, when nothing else chose one: neither the
    srun command (TNT_MPIEXEC), SLURM_MPI_TYPE nor the cluster (MpiDefault). With Slurm's own
    default, none, MPI cannot find the other tasks and each rank would train alone, as a job of
    size 1."""
    if any(word == "--mpi" or word.startswith("--mpi=") for word in srun) or os.environ.get("SLURM_MPI_TYPE"):
        return []
    if _slurm_mpi_default(srun) not in (None, "none"):
        return []
    library_launcher = _launcher_of_the_mpi_library()
    plugin = _SRUN_PMI_PLUGIN.get(_mpi_flavour([library_launcher])) if library_launcher else None
    return [f"--mpi={plugin}"] if plugin else []


def _slurm_mpi_default(srun):
    """The cluster's MpiDefault (`scontrol show config`, found beside srun first), or None."""
    beside_srun = os.path.join(os.path.dirname(shutil.which(srun[0]) or ""), "scontrol")
    scontrol = beside_srun if os.access(beside_srun, os.X_OK) else "scontrol"
    try:
        listing = subprocess.run([scontrol, "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^MpiDefault\s*=\s*(\S+)", listing, re.M)
    return match.group(1) if match else None


def count_gpus():
    """GPUs of this node, found without TensorFlow; the nodes of a job are taken to be alike."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for device in visible.split(","):  # CUDA ignores everything from the first invalid entry on
            if not device.strip() or device.strip().startswith("-"):
                break
            count += 1
        return count
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            return sum(line.startswith("GPU ") for line in listing.splitlines())
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def place_ranks(options, hosts, gpus):
    """How many ranks run on each node, and whether they use GPUs."""
    nodes = max(1, len(hosts))
    per_node = options.n_per_node
    if options.ranks is not None:
        if per_node is not None and per_node * nodes != options.ranks:
            raise LaunchError(f"-n {options.ranks} does not equal --n-per-node {per_node} x {nodes} node(s). "
                              "Give only one of them.")
        if options.ranks % nodes:
            raise LaunchError(f"-n {options.ranks} ranks cannot be spread evenly over {nodes} nodes. Give a "
                              "multiple of the node count, or --n-per-node.")
        per_node = options.ranks // nodes
    if per_node is None and hosts and not options.hostfile:
        per_node = _slurm_ranks_per_node()
    warnings = []
    if per_node is None:
        per_node = gpus or 1
        if not gpus and not options.no_gpu:
            warnings.append("no GPU found, so one rank per node runs on CPU. Choose the number of ranks with "
                            "-n or --n-per-node; --no-gpu silences this warning.")
    elif gpus < per_node and not options.no_gpu:
        fix = f"Use --n-per-node {gpus} to train on the GPUs; --no-gpu" if gpus else "--no-gpu"
        warnings.append(f"{per_node} ranks per node but {f'only {gpus}' if gpus else 'no'} GPU(s), so every "
                        f"rank runs on CPU. {fix} silences this warning.")
    if options.pin_to_socket or options.pin_memory_to_socket:
        _check_numa_nodes(per_node)
    return Placement(hosts, per_node, use_gpu=bool(gpus) and gpus >= per_node and not options.no_gpu,
                     warnings=warnings)


def _check_numa_nodes(per_node):
    if not shutil.which("numactl"):
        raise LaunchError("--pin-to-socket and --pin-memory-to-socket need numactl, which is not on PATH. "
                          "Install it (e.g. apt-get install numactl) on every node, or leave out the flags.")
    hardware = subprocess.run(["numactl", "--hardware"], capture_output=True, text=True).stdout
    match = re.search(r"available: (\d+) nodes", hardware)
    numa_nodes = int(match.group(1)) if match else 1
    if numa_nodes < per_node:
        raise LaunchError(f"cannot pin {per_node} ranks per node to sockets: this node has {numa_nodes} NUMA "
                          f"node(s). Run at most {numa_nodes} rank(s) per node (--n-per-node), or leave out "
                          "the pinning flags.")


# -- the command -------------------------------------------------------------------------------

def build_command(options, program, placement, mpiexec, flavour):
    """The launcher command line and the variables it hands to every rank."""
    environment = {"PYTHONUNBUFFERED": "1"}
    for name in sorted(os.environ):
        if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES):
            environment[name] = os.environ[name]
    settings = [("TNT_FUSION_THRESHOLD", options.fusion_threshold),
                ("TNT_OUTPUT_ON_ALL_DEVICES", "true" if options.output_on_all_devices else None),
                ("TNT_LOG_LEVEL", options.log_level),
                ("TNT_LOG_ON_ALL_DEVICES", "true" if options.log_on_all_devices else None),
                ("TNT_USE_GPU", None if placement.use_gpu else "false"),
                ("TNT_TIMELINE", os.path.abspath(options.timeline) if options.timeline else None),
                ("TNT_ANNOUNCE_RANKS", "true")]
    settings += [tuple(assignment.split("=", 1)) for assignment in options.variables]
    for name, value in settings:
        if value is not None:
            environment.pop(name, None)  # a later setting wins and takes its place in the order
            environment[name] = value
    if flavour == "openmpi" and os.geteuid() == 0:
        for name in _OPEN_MPI_ROOT_PERMISSION:
            environment.setdefault(name, "1")
    environment = list(environment.items())

    if flavour == "hydra":
        command = list(mpiexec) + _hydra_hosts(placement) + ["-n", str(placement.ranks)]
        for name, value in environment:
            command += ["-genv", name, value]
    elif flavour == "openmpi":
        command = list(mpiexec) + (["--host", _hosts_with_slots(placement)] if placement.hosts else [])
        if not placement.hosts and placement.ranks > _cores_here():
            # Open MPI gives one slot per core and refuses more ranks; Hydra runs them anyway.
            command += _open_mpi_oversubscription(mpiexec)
        command += ["-n", str(placement.ranks)]
        for name, value in environment:
            command += ["-x", f"{name}={value}"]
    elif flavour == "srun":
        command = list(mpiexec) + [f"--ntasks={placement.ranks}", f"--ntasks-per-node={placement.ranks_per_node}",
                                   "--kill-on-bad-exit=1"]
        if placement.hosts:
            command += [f"--nodes={len(placement.hosts)}", "--nodelist=" + ",".join(placement.hosts)]
        command += srun_pmi_option(mpiexec)
        # srun's --export cannot carry values with commas; env can carry anything.
        command += ["env"] + [f"{name}={value}" for name, value in environment]
    elif placement.hosts:
        raise LaunchError(f"{shlex.join(mpiexec)} is neither Hydra (MPICH, Intel MPI, MVAPICH), Open MPI nor "
                          "srun, so tarantella cannot tell it the hosts. Name a known launcher with "
                          "TNT_MPIEXEC, or run it yourself (see docs/running.md).")
    else:
        command = list(mpiexec) + ["-n", str(placement.ranks)]  # variables reach the ranks by inheritance
    return command + _pinning(options, flavour) + _rank_command(options, program), environment


def _cores_here():
    """Physical cores this process may run on: Open MPI's slots on this node (hyperthreads share one)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as file:
                cores.add(file.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def _open_mpi_oversubscription(mpiexec):
    """Open MPI 5 (prterun) deprecates --oversubscribe in favour of a mapping modifier."""
    match = re.search(r"\(Open MPI\) (\d+)\.", _version_banner(tuple(mpiexec)))
    if match and int(match.group(1)) >= 5:
        return ["--map-by", ":OVERSUBSCRIBE"]
    return ["--oversubscribe"]


def _hydra_hosts(placement):
    """Intel MPI's Hydra ignores the slots in `-hosts` and fills the first host up to its cores
    before the next; `-ppn` (MPICH's Hydra knows it too) spreads the ranks evenly."""
    if not placement.hosts:
        return []
    return ["-hosts", _hosts_with_slots(placement), "-ppn", str(placement.ranks_per_node)]


def _hosts_with_slots(placement):
    return ",".join(f"{host}:{placement.ranks_per_node}" for host in placement.hosts)


def _pinning(options, flavour):
    """A shell prefix that runs each rank under numactl on the NUMA node numbered as its local rank."""
    if not (options.pin_to_socket or options.pin_memory_to_socket):
        return []
    local_rank = "$" + LOCAL_RANK_VARIABLE.get(flavour, "MPI_LOCALRANKID")
    binding = [f"--cpunodebind={local_rank}"] if options.pin_to_socket else []
    binding.append(f"--membind={local_rank}" if options.pin_memory_to_socket else f"--preferred={local_rank}")
    return ["sh", "-c", f'exec numactl {" ".join(binding)} "$@"', "numactl-by-local-rank"]


def _rank_command(options, program):
    if options.python_interpreter is not None:
        interpreter = shlex.split(options.python_interpreter)
    else:
        interpreter = [sys.executable] if program[0].endswith(".py") else []
    if interpreter and program[0].endswith(".py"):
        # Like mpi4py's runner, it turns an uncaught exception or sys.exit(non-zero) on one rank
        # into MPI_Abort (otherwise that rank would wait in MPI_Finalize and the job would hang),
        # and it tells this command how the rank started and ended.
        return interpreter + [_RANK_ENTRY] + program
    return interpreter + program


def _find_mpiexec():
    configured = os.environ.get("TNT_MPIEXEC")
    if configured:
        command = shlex.split(configured)
        if not shutil.which(command[0]):
            raise LaunchError(f"TNT_MPIEXEC={configured!r} names {command[0]!r}, which is not an executable "
                              "program (nor on PATH). Fix TNT_MPIEXEC, or unset it to use mpiexec.")
        return command
    found = _launcher_of_the_mpi_library()
    if found:
        return [found]
    raise LaunchError("no mpiexec found. Install an MPI (e.g. pip install 'tarantella[mpich]'), put your "
                      "MPI's bin directory on PATH, or name the launcher with TNT_MPIEXEC.")


def _launcher_of_the_mpi_library():
    """The mpiexec that comes with the MPI mpi4py loads, or None."""
    # The `mpich` wheel installs mpiexec beside the interpreter, which need not be on PATH.
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside_python, os.X_OK):
        return beside_python
    return shutil.which("mpiexec") or shutil.which("mpirun")


@functools.lru_cache(maxsize=None)
def _version_banner(mpiexec):
    try:
        return subprocess.run(list(mpiexec) + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _mpi_flavour(mpiexec):
    """'hydra' (MPICH, Intel MPI, MVAPICH), 'openmpi', 'srun' or 'unknown'."""
    banner = _version_banner(tuple(mpiexec))
    if "HYDRA" in banner or "Intel(R) MPI" in banner:
        return "hydra"
    if "Open MPI" in banner or "OpenRTE" in banner or "prterun" in banner:
        return "openmpi"
    if banner.startswith("slurm"):
        return "srun"
    return "unknown"


# -- running and failures ----------------------------------------------------------------------

def _run(command, environment, ranks, hosts, start_timeout_s, flavour="unknown", mpi_name="the MPI"):
    """Runs the MPI launcher; `ranks` is how many ranks announce their start (0: none do)."""
    env = dict(os.environ)
    env.update(environment)
    # Made up for this job and handed to the ranks on their command line (which every MPI
    # launcher passes on as it is): only the ranks' own reports carry it.
    report_key = secrets.token_hex(16)
    if _RANK_ENTRY in command:
        at = command.index(_RANK_ENTRY) + 1
        command = command[:at] + [REPORT_KEY_OPTION + report_key] + command[at:]
    # Its own process group: the command stops it and all it started (ssh included) at once.
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, preexec_fn=_end_with_parent)

    interrupted = []

    def forward(signum, _frame):
        interrupted.append(signum)
        # SIGTERM, not SIGINT: each rank would print a KeyboardInterrupt traceback. The MPI
        # launcher stops every rank on every host.
        _signal_quietly(child.pid, signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    monitor = _OutputMonitor(report_key, child.pid, hosts, quiet_tensorflow=not config.tensorflow_startup_logs(),
                             flavour=flavour, mpi_name=mpi_name)
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
        elif monitor.failed and now - monitor.failed[0].at > _FAILURE_GRACE_S:
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
    if stopped_because == "finished":
        _say("tarantella: WARNING: every rank finished, but a process a rank started still held the ranks' "
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


def _end_with_parent():
    """In the MPI launcher's process: it gets SIGTERM (and stops the ranks) should the command die."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, Linux only
    except (OSError, AttributeError):
        pass


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
    _say(f"tarantella: {message}")
    return code


def _say(line):
    """Writes one of the command's own lines to its stderr. A closed stderr (`2>&-`, where Python
    sets sys.stderr to None) or a reader that went away must not change how the job ends."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, BrokenPipeError, ValueError, OSError):
        pass


# -- what each MPI's launcher says when a rank ends badly or the job cannot start -----------------

@dataclass
class _Ending:
    """A rank that ended badly, as the MPI launcher reports it."""
    rank: object  # None where the MPI names only the process id
    host: str  # "" where the MPI does not name it
    pid: str  # "" likewise
    how: object  # e.g. "Killed (signal 9)"; None: it ended with status 0 without finalizing MPI


_SAME_PATH_FIX = "check that the program and the Python interpreter exist on every host at the same path."
_SSH_FIX = "check that `ssh HOST true` works for every host without a password, and that the MPI is installed " \
           "at the same path there."


def _mpi_name(mpiexec):
    """The MPI that `mpiexec` belongs to, as its users call it."""
    banner = _version_banner(tuple(mpiexec))
    for marker, name in (("Intel(R) MPI", "Intel MPI"), ("MVAPICH", "MVAPICH"), ("HYDRA", "MPICH"),
                         ("Open MPI", "Open MPI"), ("OpenRTE", "Open MPI"), ("prterun", "Open MPI")):
        if marker in banner:
            return name
    return "the MPI"


# MPICH's Hydra

def _mpich_endings(text):
    """'PID 123 RUNNING AT node7', 'EXIT CODE: 9' (the signal's number when it was killed), then
    'EXIT STRING: Killed (signal 9)'."""
    terminated = re.search(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)", text)
    if not terminated:
        return []
    pid, host, code = terminated.groups()
    how = re.search(r"EXIT STRING: (.+)", text)
    return [_Ending(None, host, pid, how.group(1) if how else f"exit code {code}")]


# What Hydra's refusals (MPICH's and Intel MPI's) mean: (a pattern of its message, the cause, the fix).
_HYDRA_REFUSALS = [
    (r"execvp error on file (\S+) \(([^)]*)\)", r"it could not run \1 (\2)", _SAME_PATH_FIX),
    # ssh ends its lines with \r\n
    (r"ssh: ([^\r\n]*)\r?\n(?:.*\n)*?.*Launch proxy failed", r"ssh could not start its proxy on a host (\1)",
     _SSH_FIX),
    (r"Unable to run bstrap_proxy on (\S+)", r"ssh could not start its proxy on \1", _SSH_FIX),  # Intel MPI
]


def _hydra_refusal(text, mpi_name):
    for pattern, cause, fix in _HYDRA_REFUSALS:
        match = re.search(pattern, text)
        if match:
            return f"{mpi_name}'s mpiexec could not start the job: {match.expand(cause)}. Fix: {fix}"
    return None


# Intel MPI's Hydra

def _intel_mpi_endings(text):
    """'RANK 1 PID 7846 RUNNING AT node7' then 'KILLED BY SIGNAL: 9 (Killed)', for each rank it saw
    killed, including those it stopped itself; a rank that exited without finalizing is not named."""
    found = re.findall(r"RANK (\d+) PID (\d+) RUNNING AT (\S+)\s*=\s*KILLED BY SIGNAL: (\d+) \(([^)]*)\)", text)
    return [_Ending(int(rank), host, pid, f"{name} (signal {number})") for rank, pid, host, number, name in found]


# Open MPI

def _open_mpi_endings(text):
    """Its framed messages, wrapped at any word: '... process rank 1 with PID 8160 on node vm exited
    on signal 9 (Killed)', '... exiting improperly' (status 0 without finalizing MPI), and
    'Process name: [prterun-vm-27643@1,1]' with 'Exit code: 3'."""
    where = r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+"
    endings = [_Ending(int(rank), host, pid, f"{name or 'signal'} (signal {number})") for rank, pid, host, number, name
               in re.findall(where + r"exited\s+on\s+signal\s+(\d+)(?:\s+\(([^)]*)\))?", text)]
    endings += [_Ending(int(rank), host, pid, None)
                for rank, pid, host in re.findall(where + r"exiting\s+improperly", text)]
    endings += [_Ending(int(rank), "", "", f"exit status {code}")
                for rank, code in re.findall(r"Process name: \[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)", text)]
    return endings


# What Open MPI's own refusals mean for a tarantella user: (a pattern of mpirun's message, the fix).
_OPEN_MPI_REFUSAL_FIXES = [
    (r"attempt to run as root", "run as another user, or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
                                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (the tarantella command sets them itself "
                                "when it runs as root)."),
    (r"not enough slots", "ask for fewer ranks (-n), list more hosts in the hostfile, or give each host "
                          "more slots; on one node the tarantella command lets Open MPI oversubscribe."),
    (r"(?i)unable to find the specified executable|could not\s+access", _SAME_PATH_FIX),
    (r"(?i)unable to (reach|start a daemon)|daemon failed to report back|ssh|orted|prted", _SSH_FIX),
]


def _open_mpi_refusal(text, mpi_name):
    # Open MPI frames its own messages with lines of dashes; the first sentence says what is wrong.
    framed = re.search(r"^-{20,}\n(.*?)^-{20,}$", text, re.S | re.M)
    if not framed:
        return None
    paragraph = " ".join(framed.group(1).strip().split("\n\n")[0].split())
    cause = re.split(r"(?<=[a-z])\. ", paragraph)[0].rstrip(".:")
    for pattern, fix in _OPEN_MPI_REFUSAL_FIXES:
        if re.search(pattern, framed.group(1)):
            break
    else:
        fix = "see mpirun's full message above."
    return f"{mpi_name}'s mpirun refused to start the job: {cause}. Fix: {fix}"


_ENDING_READERS = (_mpich_endings, _intel_mpi_endings, _open_mpi_endings)
_REFUSAL_READERS = {"hydra": _hydra_refusal, "openmpi": _open_mpi_refusal}


@dataclass
class _FailureReport:
    """What a rank reported about its failure."""
    rank: int
    host: str
    pid: int
    error: str  # the error's name, exit-status-N or mpi-abort-N
    culprit: str  # OWN_FAILURE, UNKNOWN_CULPRIT, or the number of the rank whose failure caused this one
    summary: str
    at: float  # when it arrived (time.monotonic)

    def describe(self):
        if self.error.startswith("exit-status-"):
            return f"rank {self.rank} on host {self.host} exited with status {self.error[len('exit-status-'):]}."
        if self.error.startswith("mpi-abort-"):
            return (f"rank {self.rank} on host {self.host} (pid {self.pid}) called MPI_Abort with status "
                    f"{self.error[len('mpi-abort-'):]}.")
        return f"rank {self.rank} on host {self.host} raised {self.error}" + (
            f": {self.summary}." if self.summary else ".")


@dataclass
class _ProxyLoss:
    """A parent of ranks on this host (the MPI launcher's proxy) that ended while they ran."""
    name: str
    pid: int
    ranks: list
    at: float


class _OutputMonitor:
    """Passes the ranks' output on unchanged, and keeps their reports (those carrying this job's
    key) and what the MPI launcher says, to name the rank whose failure came first."""

    _KEPT_CHARACTERS = 1 << 16

    def __init__(self, report_key, launcher_pid, hosts_expected=(), quiet_tensorflow=True, flavour="unknown",
                 mpi_name="the MPI"):
        self._report_prefix = f"{RANK_ANNOUNCEMENT}{report_key} "
        self.launcher_pid = launcher_pid
        self.hosts_expected = hosts_expected
        self.flavour = flavour
        self.mpi_name = mpi_name
        self.quiet_tensorflow = quiet_tensorflow
        self.started = {}  # rank -> host, from the rank's first report
        self.pids = {}  # rank -> pid
        self.finished = set()
        self.finished_at = {}  # rank -> when it announced the end of the program
        self.failed = []  # _FailureReport, in the order they arrived
        self.ended_at = {}  # rank -> when its process ended (ranks on this host)
        self.proxy_losses = []
        self._parents = {}  # pid of a parent of ranks on this host -> those ranks
        self._running_here = {}  # rank -> pidfd of its process, while it runs on this host
        self.recent = ""
        self._lock = threading.Lock()
        self._broken_streams = set()

    def _keep(self, text):
        with self._lock:
            self.recent = (self.recent + text)[-self._KEPT_CHARACTERS:]

    def _write(self, stream, data):
        """Writes on; a reader that went away (`| head`) must not stop the job or its output. A
        closed stream (`>&-`: Python's sys.stdout is None) takes nothing, but the ranks' pipes are
        still drained, or a rank with much output would block in its write."""
        if stream is None or stream in self._broken_streams:
            return
        try:
            stream.buffer.write(data)
            stream.buffer.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._broken_streams.add(stream)
            try:  # Python's own flush at exit would complain about the closed pipe again
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):
                pass

    def pass_on_stdout(self, stream):
        # Raw chunks, not lines: progress bars redraw with '\r' and must appear as they come.
        while chunk := os.read(stream.fileno(), 1 << 16):
            self._write(sys.stdout, chunk)
            self._keep(chunk.decode(errors="replace"))

    def pass_on_stderr(self, stream):
        for line in stream:
            if not line.strip(b"\0"):  # prterun (Open MPI 5) ends its stderr with a NUL byte
                continue
            text = line.decode(errors="replace")
            if text.startswith(self._report_prefix):
                self._note(text[len(self._report_prefix):].strip().split(maxsplit=6))
                continue
            if self.quiet_tensorflow and (_TENSORFLOW_INFO_LINE.match(text) or text.startswith(
                    (_ABSL_BANNER, _CPU_FEATURES_CONTINUATION))):
                continue
            self._write(sys.stderr, line)
            self._keep(text)

    def _note(self, fields):
        """One report: EVENT RANK HOST PID, then the parent's pid (started) or ERROR CULPRIT
        SUMMARY (failed)."""
        if len(fields) < 4 or not fields[1].isdigit() or not fields[3].isdigit():
            return
        event, rank, host, pid, *details = fields
        rank = int(rank)
        if event == STARTED:
            self.started[rank] = host
            self.pids[rank] = int(pid)
            if host == socket.gethostname():
                parent = int(details[0]) if details and details[0].isdigit() else None
                self._watch_here(rank, int(pid), parent)
        elif event == FINISHED:
            self.finished.add(rank)
            self.finished_at[rank] = time.monotonic()
        elif event == FAILED:
            error, culprit, summary = (details + ["an error", OWN_FAILURE, ""][len(details):])[:3]
            self.failed.append(_FailureReport(rank, host, int(pid), error, culprit, summary, time.monotonic()))

    def _watch_here(self, rank, pid, parent):
        """Notes when a rank's process on this host ends (the first to end is the one that left),
        and when its parent (the MPI launcher's proxy) ends while it still runs."""
        try:
            handle = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return
        self._running_here[rank] = handle
        threading.Thread(target=self._wait_for_end, args=(rank, handle), daemon=True).start()
        if parent is not None and parent not in self._parents:
            self._parents[parent] = []
            threading.Thread(target=self._watch_parent, args=(parent,), daemon=True).start()
        if parent is not None:
            self._parents[parent].append((rank, pid))

    def _wait_for_end(self, rank, handle):
        select.select([handle], [], [])
        self.ended_at[rank] = time.monotonic()
        with self._lock:
            self._running_here.pop(rank, None)
        os.close(handle)

    def _watch_parent(self, pid):
        try:
            handle = os.pidfd_open(pid)
            with open(f"/proc/{pid}/comm") as file:
                name = file.read().strip()
        except (OSError, AttributeError):
            return
        select.select([handle], [], [])
        os.close(handle)
        # A proxy ends after its ranks, or kills them as it ends (after a rank failed or called
        # MPI_Abort); they are gone a moment later. Ranks that lost their proxy live on a while.
        time.sleep(_PROXY_LOSS_CHECK_S)
        ranks = self._parents[pid]
        if all(_running_on(rank_pid) for _, rank_pid in ranks):
            self.proxy_losses.append(_ProxyLoss(name, pid, sorted(rank for rank, _ in ranks), time.monotonic()))

    def proxy_loss_settled(self, now):
        """True once a proxy on this host was lost and its ranks have ended since (they end
        themselves when their parent is gone), or a grace period passed."""
        return any(all(rank in self.ended_at for rank in loss.ranks) or now - loss.at > _FAILURE_GRACE_S
                   for loss in self.proxy_losses)

    def stop_ranks_left_here(self):
        """Kills the ranks on this host that still run once the MPI launcher is gone: nothing
        else would ever stop them."""
        with self._lock:
            handles = list(self._running_here.values())
        for handle in handles:
            try:
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass

    def every_rank_ended(self, ranks, now):
        """Whether all `ranks` finished the program and their processes are gone (on this host,
        seen ended a grace period ago; on others, announced a longer grace period ago)."""
        if len(self.finished) < ranks or self.failed:
            return False
        here = socket.gethostname()
        for rank in self.finished:
            if self.started.get(rank) == here:
                if now - self.ended_at.get(rank, now) < _ENDED_GRACE_S:
                    return False
            elif now - self.finished_at[rank] < _REMOTE_ENDED_GRACE_S:
                return False
        return True

    def start_failure(self, ranks, timeout_s):
        joined = set(self.started.values())
        missing = [host for host in self.hosts_expected if host not in joined and
                   host.split(".")[0] not in {name.split(".")[0] for name in joined}]
        where = f"; hosts that never joined: {', '.join(missing)}" if missing else ""
        return (f"only {len(self.started)} of {ranks} ranks started within {timeout_s:g} s "
                f"(TNT_START_TIMEOUT){where}. Check that `ssh HOST true` works for every host without a "
                "password, and that the hosts can reach each other.")

    def _first_rank_to_end(self, excluding=()):
        """Of the ranks on this host that did not finish the program, the first whose process ended."""
        gone = [rank for rank in self.ended_at if rank not in self.finished and rank not in excluding]
        return min(gone, key=self.ended_at.get) if gone else None

    def ranks_that_left_early(self, status_known_zero=True):
        """A description of the ranks that ended without finishing the program and without an error
        that Python saw (with status 0, where the MPI tells)."""
        gone = sorted(set(self.started) - self.finished)
        if not gone:
            return None
        first = self._first_rank_to_end()
        if first is not None:
            gone = [first]
        listing = ", ".join(f"rank {rank} on host {self.started[rank]}" for rank in gone)
        status = "with status 0 " if status_known_zero else ""
        return (f"{listing} left early: it ended {status}without finishing the program (e.g. "
                "os._exit), and the MPI launcher stopped the other ranks. Their unfinished work (saves, "
                "output) is lost. End a rank by returning from the program or with sys.exit.")

    def failure(self, status, launcher_killed_by=None):
        """Which rank failed first, on which host, and how: from the ranks' reports and what this
        command saw on this host; the MPI launcher's words only for ranks elsewhere."""
        first_report = self.failed[0].at if self.failed else float("inf")
        if launcher_killed_by:
            return (f"the MPI launcher (pid {self.launcher_pid}) was killed by {launcher_killed_by} while the "
                    f"ranks ran; the command stopped the ranks left on this host.")
        losses = [loss for loss in self.proxy_losses if loss.at < first_report]
        if losses:
            loss = losses[0]
            ranks = ", ".join(map(str, loss.ranks))
            who = "the MPI launcher" if loss.pid == self.launcher_pid else "the MPI launcher's proxy"
            return (f"{who} on host {socket.gethostname()} ({loss.name}, pid {loss.pid}) ended while rank(s) {ranks} "
                    "ran there (killed, e.g. by the out-of-memory killer, or its ssh connection dropped); the "
                    "ranks were stopped.")
        causes = [report for report in self.failed if report.culprit == OWN_FAILURE]
        if causes:
            return causes[0].describe()
        aborted = self._aborted(status)
        if aborted is not None:
            return aborted
        ended = self._ended_without_a_report(before=first_report)
        if ended is not None:
            return ended
        consequence = self._consequence_naming_the_culprit()
        if consequence is not None:
            return consequence.describe()
        if not self.started:
            return "the MPI launcher ended before any rank started; see its messages above."
        unfinished = sorted(set(self.started) - self.finished)
        if unfinished:
            # E.g. a proxy on another host lost: MPICH's mpiexec then ends at once, before the
            # ranks there or their peers can report.
            listing = ", ".join(f"rank {rank} on host {self.started[rank]}" for rank in unfinished)
            return (f"the MPI launcher ended while {listing} had not finished, and no rank reported a failure: "
                    "it lost one of its own processes (a proxy killed, or an ssh connection dropped); see its "
                    "messages above.")
        return "no rank reported a failure; see the MPI launcher's messages above."

    def _aborted(self, status):
        """The rank that called MPI_Abort itself without tarantella's report (a program without
        tarantella, or one that kept MPI.COMM_WORLD from before `import tarantella`), as its MPI
        library says, where that agrees with the job's exit status. (The MPI launcher kills the
        other ranks while the aborting one waits, so it is not the first to end; and it may drop
        this message.)"""
        for pattern in (r"Abort\((?P<code>\d+)\) on node \d+ \(rank (?P<rank>\d+) in comm 0\)",  # MPICH
                        r"MPI_ABORT was invoked on rank (?P<rank>\d+) in communicator MPI_COMM_WORLD\s+with "
                        r"errorcode (?P<code>\d+)"):  # Open MPI
            for match in re.finditer(pattern, self.recent):
                rank, code = int(match["rank"]), int(match["code"])
                if code == status and rank in self.started and not any(r.rank == rank for r in self.failed):
                    return (f"rank {rank} on host {self.started[rank]} (pid {self.pids[rank]}) called MPI_Abort "
                            f"with status {code}.")
        return None

    def _ended_without_a_report(self, before):
        """A rank that ended, without a report of its own and without finishing, before any failure
        report arrived. On this host the first to end: as the MPI launcher says it ended, or, where
        it names no signal or error for that very process, as having left early. Elsewhere, only a
        rank the MPI launcher says ended abnormally."""
        reported = {report.rank for report in self.failed}
        endings = [ending for read in _ENDING_READERS for ending in read(self.recent)]
        first = self._first_rank_to_end(excluding=reported)
        if first is not None and self.ended_at[first] < before:
            said = [ending for ending in endings if self._is_process_of(ending, first)]
            if said and said[0].how:
                return (f"rank {first} on host {self.started[first]} (pid {self.pids[first]}) ended: "
                        f"{said[0].how}.")
            return self.ranks_that_left_early(status_known_zero=bool(said))
        here = socket.gethostname()
        for ending in endings:
            for rank, host in self.started.items():
                if (host != here and rank not in self.finished and rank not in reported and ending.how
                        and self._is_process_of(ending, rank)):
                    return f"rank {rank} on host {host} (pid {self.pids[rank]}) ended: {ending.how}."
        return None

    def _is_process_of(self, ending, rank):
        """Whether the MPI launcher's `ending` is about this job's `rank`: by the rank where the MPI
        names it (Open MPI 4 may give pid 0), else by its very pid."""
        if ending.rank is not None:
            return ending.rank == rank
        if ending.pid != str(self.pids.get(rank)):
            return False
        # The MPI may name the host as the hostfile does (an address): then the pid alone must tell.
        host = ending.host.split(".")[0]
        alike = [other for other, pid in self.pids.items() if str(pid) == ending.pid]
        return not host or host == self.started.get(rank, "").split(".")[0] or alike == [rank]

    def _consequence_naming_the_culprit(self):
        """The report that names the first rank in a chain of consequences (the rank that
        failed first, without reporting it), else a report of a broken MPI call."""
        by_rank = {}
        for report in self.failed:
            by_rank.setdefault(report.rank, report)
        for report in self.failed:
            seen = set()
            while report.culprit.isdigit() and int(report.culprit) in by_rank and report.rank not in seen:
                seen.add(report.rank)
                blamed = by_rank[int(report.culprit)]
                if blamed.culprit == UNKNOWN_CULPRIT:
                    break
                report = blamed
            if report.culprit != UNKNOWN_CULPRIT:
                return report
        return self.failed[0] if self.failed else None

    def launcher_refusal(self):
        """One line naming the MPI, the cause and the fix, when the MPI launcher refused to start the
        job (no rank started, and its message is one this command knows); else None."""
        read = _REFUSAL_READERS.get(self.flavour)
        if not read or self.started:
            return None
        return read(self.recent, self.mpi_name)


# -- cleanup -------------------------------------------------------------------------------------

def _cleanup(options, program, hosts):
    signal_name = "SIGKILL" if options.force else "SIGTERM"
    if not hosts:
        if options.dry_run:
            print(f"would send {signal_name} to your processes on this node whose command line names "
                  f"{os.path.basename(program[0])}")
            return 0
        return _stop_processes_here(signal_name, program[0])
    mpiexec = _find_mpiexec()
    flavour = _mpi_flavour(mpiexec)
    per_host = Placement(hosts, ranks_per_node=1, use_gpu=False, warnings=[])
    if flavour == "hydra":
        command = list(mpiexec) + _hydra_hosts(per_host) + ["-n", str(len(hosts))]
    elif flavour == "openmpi":
        command = list(mpiexec) + ["--host", _hosts_with_slots(per_host), "-n", str(len(hosts))]
    elif flavour == "srun":
        command = list(mpiexec) + [f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                                   "--nodelist=" + ",".join(hosts)]
    else:
        raise LaunchError(f"{shlex.join(mpiexec)} is an unknown MPI launcher, so --cleanup cannot reach the "
                          "hosts. Name mpiexec, mpirun or srun with TNT_MPIEXEC.")
    command += [sys.executable, "-m", "tarantella.launcher", _STOP_HERE, signal_name, program[0]]
    if options.dry_run:
        print("command:\n  " + shlex.join(command))
        return 0
    return subprocess.run(command).returncode


def _stop_processes_here(signal_name, program):
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
        if _STOP_HERE not in arguments and any(os.path.basename(argument) == name for argument in arguments):
            matching.append(int(entry))
    for pid in matching:
        try:
            os.kill(pid, getattr(signal, signal_name))
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _CLEANUP_GRACE_S
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


def _running_on(pid):
    """True while the process runs and is not being torn down (e.g. after SIGKILL)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _EXITING


if __name__ == "__main__":
    sys.exit(main())
