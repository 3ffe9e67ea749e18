"""The world of this process: MPI started (or a serial stand-in), the communicator every collective
runs on, the gradient reducers, this rank's share of its node, and the rank queries."""

from __future__ import annotations

import atexit
import logging
import os
import sys

from tarantella.common import config, rank_entry
from tarantella.runtime import failure, link
from tarantella.runtime.communicator import MASTER_RANK, Communicator
from tarantella.runtime.errors import collective_failure_behind
from tarantella.runtime.node import NodeShare, bind_to_own_cores
from tarantella.runtime.reducer import ByNode, Reducer, SixteenBitWire, SumOverRanks
from tarantella.runtime.serial import SerialMPI

# What the package publishes of this module (as tnt.get_rank, ...); its other functions serve the package.
__all__ = ["get_master_rank", "get_rank", "get_size", "is_master_rank"]

logger = logging.getLogger("tarantella")

_world = None
_MPI = None  # mpi4py's MPI module, or SerialMPI
_reducers = {}  # wire -> its Reducer
_node_share = None
_link = None  # the slowest link between ring neighbours, where the job spans several nodes
# Set in every rank by the MPI launchers (Hydra, Open MPI, PMIx) and by the `tarantella` command.
_LAUNCHER_VARIABLES = ("TNT_ANNOUNCE_RANKS", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def mpi():
    """The MPI module collectives use: mpi4py's, or a serial stand-in where no MPI is installed."""
    init()
    return _MPI


def gradient_reducer(wire="float32"):
    """The reducer of the training steps' gradient buckets that sends them as `wire` ("float32",
    "bfloat16" or "float16"): one per wire and process, all on the world's worker."""
    init()
    if wire not in _reducers:
        _reducers[wire] = Reducer(_world, SixteenBitWire(_reducers["float32"].reduction, wire))
    return _reducers[wire]


def node_share():
    """This rank's NodeShare: its local rank, the ranks on its node, whether it bound its cores."""
    init()
    return _node_share


def slowest_link():
    """The link.Link measured at start-up between ring neighbours, the same on every rank, where
    the job spans several nodes; None on one node, where no network lies between the ranks."""
    init()
    return _link


def init() -> Communicator:
    """Starts MPI, configures this process as one rank and returns its communicator.

    Safe to call again: later calls return the same communicator.

    Returns:
        the rank's communicator (`rank` and `size` attributes).

    Raises:
        ImportError: the process was started as a rank of a parallel job, but no MPI is installed.
        RuntimeError: the MPI launcher and the MPI library do not fit (every rank a job of its own).
        ValueError: a `TNT_*` setting of the environment is invalid.
    """
    global _world, _MPI, _node_share, _link
    if _world is not None:
        return _world
    setting_warnings = config.check_environment()  # bad settings fail here, on every rank, before any collective
    missing_mpi = None
    worker = _multiprocessing_worker()
    try:
        if worker:
            # It inherited its rank's MPI variables, but it is no rank: joining MPI would fail
            # (endless PMI errors) or, worse, disturb its rank's connection to the MPI launcher.
            raise ImportError(f"a {worker} worker process of a rank, which runs without MPI")
        from mpi4py import MPI
    except (ImportError, RuntimeError) as error:  # no mpi4py, or mpi4py without an MPI library
        if _started_by_an_mpi_launcher() and not worker:
            raise ImportError(
                f"tarantella found no MPI ({str(error).splitlines()[0]}), but this process was started as a "
                "rank of a parallel job. Install MPI for it: pip install 'tarantella[mpich]', or a system "
                "MPI (e.g. apt-get install libmpich-dev) with mpi4py, pointing MPI4PY_LIBMPI at its "
                "libmpi.so.") from None
        missing_mpi = str(error).splitlines()[0] if str(error) else type(error).__name__
        MPI = SerialMPI
    _MPI = MPI
    world = MPI.COMM_WORLD
    _check_the_launcher_reached_mpi(MPI)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    bound_to_own_cores = local_size > 1 and config.bind_cores() and bind_to_own_cores(node, local_rank)
    by_node_settings = world.allgather((local_size if local_rank == 0 else 0, config.hierarchical_allreduce()))
    ranks_per_node = [size for size, _ in by_node_settings]
    nodes = sum(1 for size in ranks_per_node if size)
    if len({setting for _, setting in by_node_settings}) > 1:
        node.Free()
        raise ValueError("TNT_HIERARCHICAL_ALLREDUCE differs between ranks (" + ", ".join(
            f"rank {rank}: {setting}" for rank, (_, setting) in enumerate(by_node_settings)) + "); give every rank "
            "the same (the `tarantella` command's -x passes it to all).")
    _node_share = NodeShare(local_rank, local_size, bound_to_own_cores, nodes)
    if nodes > 1:  # a few milliseconds; every rank takes part whatever its TNT_FUSION_THRESHOLD
        _link = link.measure(MPI, world)
    side = world.Dup() if world.Get_size() > 1 else None
    _world = Communicator(MPI, world.Dup(), config.collective_timeout_s(), side_comm=side,
                          stall_warning_s=config.stall_warning_s())
    sum_over_ranks = SumOverRanks(MPI, ring=config.ring_allreduce())
    if world.Get_size() > 1 and _by_node(by_node_settings[0][1], nodes, max(ranks_per_node)):
        leaders = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, world.Get_rank())
        sum_over_ranks = ByNode(sum_over_ranks, node, None if leaders == MPI.COMM_NULL else leaders)
    else:
        node.Free()
    _reducers["float32"] = Reducer(_world, sum_over_ranks)
    if _world.peers is not None:
        # Registered after MPI's own exit handler, so it runs first, while MPI still works.
        atexit.register(failure.finish, _world)
    _configure_logging(_world.rank)
    if not config.announce_ranks():  # started by the tarantella command, which said these already
        for warning in setting_warnings:
            logger.warning(warning)
    if missing_mpi is not None:
        logger.info("no MPI (%s): running as a single process, without MPI.", missing_mpi)
    if _world.size > 1:
        failure.stop_all_ranks_on_uncaught_error(_world.rank)
        rank_entry.unwrap_failure = collective_failure_behind
        rank_entry.tell_other_ranks = tell_other_ranks_this_one_failed
        rank_entry.watch_parent()  # started already where the `tarantella` command runs the rank
        if rank_entry.reports_to_the_command():
            failure.report_the_programs_mpi_aborts(MPI)
    return _world



def _by_node(setting, nodes, most_ranks_on_a_node):
    """Whether large gradient buckets are summed node by node (TNT_HIERARCHICAL_ALLREDUCE): `auto`
    where several nodes hold several ranks each (one node has nothing to cross; one rank per node
    nothing to gather first)."""
    if setting == "auto":
        return nodes > 1 and most_ranks_on_a_node > 1
    return setting == "on"


def _started_by_an_mpi_launcher():
    slurm_tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")  # srun; a batch script's own step has 1
    return any(os.environ.get(name) for name in _LAUNCHER_VARIABLES) or (slurm_tasks.isdigit() and
                                                                         int(slurm_tasks) > 1)


def _check_the_launcher_reached_mpi(MPI):
    """The launcher started several ranks but MPI sees one: the launcher and the MPI library do not
    fit (srun's PMI plug-in, or an mpiexec of another MPI than the one mpi4py loaded), and every
    rank became a job of its own. Each would train alone, all as the master, writing the same files.
    (A process that runs without MPI, such as a rank's worker process, inherits the launcher's
    variables but is no rank.)"""
    if MPI is SerialMPI or MPI.COMM_WORLD.Get_size() != 1:
        return
    if "SLURM_STEP_NUM_TASKS" in os.environ:
        tasks = os.environ.get("PMI_SIZE") or os.environ["SLURM_STEP_NUM_TASKS"]
        if tasks.isdigit() and int(tasks) > 1:
            chosen = os.environ.get("SLURM_MPI_TYPE", "none")
            raise RuntimeError(
                f"srun started {tasks} tasks, but MPI made each of them a job of its own (size 1): srun's PMI "
                f"plug-in ({chosen}) does not suit this MPI library. Start the ranks with `srun --mpi=pmi2` (MPICH, "
                "Intel MPI) or `srun --mpi=pmix` (Open MPI); `srun --mpi=list` shows what the cluster offers. Or "
                "run the `tarantella` command inside the allocation, which chooses for you.")
        return
    for variable, launcher in (("PMI_SIZE", "a Hydra mpiexec (MPICH, Intel MPI, MVAPICH)"),
                               ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun")):
        ranks = os.environ.get(variable, "")
        if ranks.isdigit() and int(ranks) > 1:
            library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
            raise RuntimeError(
                f"{launcher} started {ranks} ranks, but the MPI library that mpi4py loaded ({library}) made each "
                "of them a job of its own (size 1): the launcher belongs to another MPI than the library. Start "
                "the ranks with the mpiexec of the same MPI (the `tarantella` command picks the one beside this "
                "Python first), or point mpi4py at the launcher's library with MPI4PY_LIBMPI=/path/to/libmpi.so.")


def _multiprocessing_worker():
    """'spawn' or 'forkserver' in a process that Python's multiprocessing started that way (e.g. a
    data loader's worker pool), which imports the program's main module, and with it tarantella;
    else None. (A forked worker is a copy of its rank and never imports tarantella anew.)"""
    arguments = " ".join(getattr(sys, "orig_argv", sys.argv))
    if "--multiprocessing-fork" in arguments or "multiprocessing.spawn" in arguments:
        return "spawn"
    if "multiprocessing.forkserver" in arguments:
        return "forkserver"
    return None


def tell_other_ranks_this_one_failed(summary):
    """Tells the other ranks (when MPI runs here) that this one fails as `summary` says, so that
    they fail naming it at their next collective instead of waiting for it there."""
    if _world is not None and _world.peers is not None:
        _world.peers.announce_failure(summary)


def get_rank() -> int:
    """This process's rank: 0 for the master, up to `get_size() - 1`.

    Returns:
        int: the rank; 0 in a serial run.
    """
    return init().rank


def get_size() -> int:
    """The number of ranks in the job.

    Returns:
        int: the number of ranks; 1 in a serial run.
    """
    return init().size


def get_master_rank() -> int:
    """The master's rank, which writes files and prints Keras' output.

    Returns:
        int: always 0.
    """
    return MASTER_RANK


def is_master_rank() -> bool:
    """Whether this process is the master (rank 0), e.g. to print something once.

    Returns:
        bool: True on rank 0.
    """
    return get_rank() == MASTER_RANK


def _configure_logging(rank):
    on_all = config.log_on_all_devices()
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[tarantella rank {rank}]" if on_all else "[tarantella]"
    handler.setFormatter(logging.Formatter(prefix + " %(levelname)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(config.log_level() if on_all or rank == MASTER_RANK else "ERROR")
