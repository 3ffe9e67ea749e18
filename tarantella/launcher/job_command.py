"""The command line that runs a job: the MPI launcher's part (from its flavour), the variables
every rank gets, the NUMA pinning, and what each rank runs."""

import os
import shlex
import sys

from tarantella.common import rank_entry

# Variables every rank on every host gets from the launcher's environment (Open MPI, unlike
# Hydra, passes almost nothing on by itself).
# TensorFlow's variables by their documented prefixes, not every TF_ (Terraform uses TF_ too).
FORWARDED_PREFIXES = ("TNT_", "KERAS_", "JAX_", "XLA_", "MPI4PY_", "TF_CPP_", "TF_ENABLE_", "TF_FORCE_", "TF_GPU_",
                      "TF_XLA_", "TF_NUM_", "TF_CUDNN_", "TF_DETERMINISTIC_", "TF_USE_LEGACY_KERAS")
FORWARDED_NAMES = ("PYTHONPATH",)
# What every rank runs first, as a file (rank_entry.py says why).
RANK_ENTRY = os.path.abspath(rank_entry.__file__)


def build(options, program, placement, mpi):
    """The launcher command line and the variables it hands to every rank (name and value pairs)."""
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
                ("TNT_ANNOUNCE_RANKS", "true"),
                ("GLIBC_TUNABLES", _with_transparent_huge_pages(os.environ.get("GLIBC_TUNABLES")))]
    settings += [tuple(assignment.split("=", 1)) for assignment in options.variables]
    for name, value in settings:
        if value is not None:
            environment.pop(name, None)  # a later setting wins and takes its place in the order
            environment[name] = value
    for name, value in mpi.rank_environment().items():
        environment.setdefault(name, value)
    environment = list(environment.items())
    command = mpi.launch_command(placement, environment)
    return command + _pinning(options, mpi) + _rank_command(options, program), environment


def _with_transparent_huge_pages(tunables):
    """glibc's settings for the ranks, with its large blocks backed by transparent huge pages
    (unless the user chose otherwise). XLA's scratch memory for a step of the MLP of
    benchmarks/scaling.py (41 MB, above glibc's 32 MB pool) is mapped anew every step; in 4 KiB
    pages that cost 9,900 page faults per step, a quarter of its JAX step time on 2 ranks."""
    if tunables and "glibc.malloc.hugetlb=" in tunables:
        return tunables
    return ":".join(filter(None, [tunables, "glibc.malloc.hugetlb=1"]))


def print_dry_run(command, environment, placement):
    print("command:")
    print("  " + shlex.join(command))
    print("environment (added for every rank, in this order):")
    for name, value in environment:
        print(f"  {name}={value}")
    where = ", ".join(placement.hosts) if placement.hosts else "this node"
    device = "GPU" if placement.use_gpu else "CPU"
    print(f"ranks: {placement.ranks} ({placement.ranks_per_node} per node on {where}, {device})")


def _pinning(options, mpi):
    """A shell prefix that runs each rank under numactl on the NUMA node numbered as its local rank."""
    if not (options.pin_to_socket or options.pin_memory_to_socket):
        return []
    local_rank = "$" + mpi.local_rank_variable
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
        return interpreter + [RANK_ENTRY] + program
    return interpreter + program
