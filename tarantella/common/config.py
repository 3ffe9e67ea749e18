"""Settings read from the environment (the launcher sets them; users may too)."""

import difflib
import math
import os
import signal
from typing import NamedTuple

DEFAULT_SHUFFLE_SEED = 42


class Setting(NamedTuple):
    """One `TNT_*` setting: what the accessor below reads, and what the documentation's table shows."""
    name: str
    type: str            # "boolean", "number", "choice", "whole number", "file", "folder" or "command"
    default: object      # the value where the variable is unset or empty
    meaning: str         # one line, for the documentation
    flag: str = ""       # the `tarantella` option that sets it ("" where only the environment does)
    minimum: float = 0   # numbers: the smallest value accepted
    unit: str = ""       # numbers: what they count, as the error messages say it
    choices: tuple = ()  # choices: the values accepted
    shown_default: str = ""  # the documentation's words for the default, where `default` alone says too little
    set_by_command: bool = False  # the `tarantella` command sets it for its own use; users leave it unset


# The exit status of a job that saved a backup on the cluster's warning signal and stopped (EX_TEMPFAIL
# of sysexits.h: try again later), so that a batch script can requeue exactly those jobs.
SAVED_AND_STOPPED_STATUS = 75

# The types gradients may travel in between ranks; "auto" picks the variables' own 16-bit type, else float32.
GRADIENT_WIRES = ("auto", "float32", "bfloat16", "float16")

# Every setting a user may give (and the two the command sets for itself), in the documentation's order.
SETTINGS = {setting.name: setting for setting in (
    Setting("TNT_FUSION_THRESHOLD", "number", None, "smallest fused gradient allreduce, in KiB; 0 sends every "
            "gradient on its own", flag="--fusion-threshold KB", minimum=0, unit="kilobytes",
            shown_default="32 on one node; across nodes 512 per rank, at most 16384"),
    Setting("TNT_TIMELINE", "file", None, "write a trace of every rank's steps and collectives to this file, and "
            "print a step report after each `fit`", flag="--timeline FILE", shown_default="off"),
    Setting("TNT_OUTPUT_ON_ALL_DEVICES", "boolean", False, "Keras output (progress bars, summary, callback "
            "messages) from every rank", flag="--output-on-all-devices", shown_default="master only"),
    Setting("TNT_LOG_LEVEL", "choice", "WARNING", "tarantella's log level", flag="--log-level",
            choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting("TNT_LOG_ON_ALL_DEVICES", "boolean", False, "tarantella's log lines from every rank, each tagged "
            "with its rank", flag="--log-on-all-devices", shown_default="master only"),
    Setting("TNT_TENSORBOARD_ON_ALL_DEVICES", "boolean", False, "TensorBoard writes one folder per rank, "
            "`<log_dir>/rank_<r>`", shown_default="master only"),
    Setting("TNT_COLLECTIVE_TIMEOUT", "number", 600.0, "seconds a rank waits for the others in one collective "
            "before it raises `CollectiveTimeoutError`", minimum=1, unit="seconds"),
    Setting("TNT_STALL_WARNING", "number", 60.0, "seconds a rank waits in one collective before it warns once, "
            "naming the missing ranks", minimum=1, unit="seconds"),
    Setting("TNT_START_TIMEOUT", "number", 120.0, "seconds the `tarantella` command waits for every rank to "
            "start before it stops the job, naming the hosts that never joined", minimum=1, unit="seconds"),
    Setting("TNT_TENSORFLOW_STARTUP_LOGS", "boolean", False, "the `tarantella` command shows TensorFlow's C++ "
            "start-up lines (oneDNN, CPU features)", shown_default="hidden"),
    Setting("TNT_THREADS_PER_RANK", "number", 0, "TensorFlow threads per rank; 0 picks them", minimum=0,
            unit="threads", shown_default="the cores of the rank's own share, else cores per node / ranks per "
            "node"),
    Setting("TNT_BIND_CORES", "boolean", True, "ranks of a node that may all run on the same cores split them, "
            "each binding its threads to its own share; ranks bound already keep their binding"),
    Setting("TNT_ALLREDUCE", "choice", "ring", "`ring`: large gradient buckets go through tarantella's ring "
            "allreduce; `mpi`: always `MPI_Allreduce`", choices=("ring", "mpi")),
    Setting("TNT_HIERARCHICAL_ALLREDUCE", "choice", "auto", "large gradient buckets summed within each node "
            "first (shared memory), then across the nodes by one rank per node, then shared within the node: `on` "
            "or `off` forces either", choices=("auto", "on", "off"),
            shown_default="`auto`: on where several nodes hold several ranks each"),
    Setting("TNT_GRADIENT_WIRE", "choice", "auto", "the type gradients travel in between ranks: `bfloat16` or "
            "`float16` halve the bytes (rounded once before sending, added in float32); `float32` sends them "
            "exactly; a `tnt.Model(gradient_wire=...)` argument overrides it", choices=GRADIENT_WIRES,
            shown_default="`auto`: the variables' own type where it is 16-bit, else `float32`"),
    Setting("TNT_JAX_GRADIENT_HANDOVER", "choice", "auto", "Keras' JAX backend on CPUs: `per-bucket` hands each "
            "gradient bucket to the allreduce as XLA computes it, overlapping backprop; `after-backprop` sums "
            "them all after it", choices=("auto", "per-bucket", "after-backprop"),
            shown_default="`auto`: per-bucket across nodes, after-backprop on one node"),
    Setting("TNT_USE_GPU", "boolean", True, "`false`: every rank runs on CPU (the command sets it with "
            "`--no-gpu`, or where a node has fewer GPUs than ranks)", flag="--no-gpu"),
    Setting("TNT_SHARE_GPUS", "boolean", False, "with fewer GPUs than ranks on a node, the ranks share them "
            "(rank r takes GPU r mod G) instead of all running on CPU"),
    Setting("TNT_BACKUP_DIR", "folder", None, "the folder into which `fit` backs up by itself, and from which a "
            "restarted job resumes", flag="--backup-dir (with --max-restarts)",
            shown_default="no automatic backups"),
    Setting("TNT_BACKUP_EVERY_STEPS", "whole number", None, "with automatic backups, also back up after every "
            "this many steps", flag="--backup-every-steps", minimum=1, shown_default="at every epoch's end only"),
    Setting("TNT_SAVE_ON_SIGNAL", "choice", None, "the cluster's warning signal: when the command or a rank "
            "gets it, every rank stops at one step, the master backs up, and the job exits with status 75",
            flag="--save-on-signal", choices=("USR1", "USR2", "TERM"), shown_default="off"),
    Setting("TNT_KEEP_CHILD_PROCESSES", "boolean", False, "processes a rank's program started and left running "
            "outlive the rank; by default they are ended (SIGTERM, then SIGKILL after 3 s) with a line naming them",
            shown_default="ended when the rank ends"),
    Setting("TNT_MPIEXEC", "command", None, "the MPI launcher the `tarantella` command runs: Hydra's `mpiexec`, "
            "Open MPI's `mpirun`, or `srun`", shown_default="`mpiexec` next to Python, then on `PATH`"),
    Setting("TNT_RESTART_ATTEMPT", "whole number", 0, "which attempt of the job this is: 0, then k for the k-th "
            "restart", flag="(set by --max-restarts)", minimum=0, set_by_command=True),
    Setting("TNT_ANNOUNCE_RANKS", "boolean", False, "each rank tells the command its host and process id, so "
            "that a failed rank's host can be named", flag="(set by the command)", set_by_command=True),
)}


def _default(name):
    return SETTINGS[name].default


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(name, default):
    """The boolean setting `name`; `default` where it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean; use {name}=true or {name}=false.")


def _number(name, default, minimum, unit):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    # A setting whose default depends on the job (None) has no single value to show as an example.
    example = "" if default is None else f", e.g. {name}={default:g}"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a number of {unit}; set it to a number >= {minimum:g}{example}.") from None
    if not math.isfinite(value):  # nan compares false with everything: it would disable the limit
        raise ValueError(f"{name}={raw!r} must be a finite number of {unit} >= {minimum:g}{example}.")
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum:g} {unit}.")
    return value


def _read_number(name):
    setting = SETTINGS[name]
    return _number(name, setting.default, setting.minimum, setting.unit)


def fusion_threshold_bytes():
    """Minimum size of one fused gradient allreduce the user chose (0 sends every gradient on its own),
    or None where the job's placement chooses it (`backends.fusion_threshold_bytes`)."""
    kilobytes = _read_number("TNT_FUSION_THRESHOLD")
    return None if kilobytes is None else int(kilobytes * 1024)


def collective_timeout_s():
    """How long a rank waits for the others in one collective before it gives up."""
    return _read_number("TNT_COLLECTIVE_TIMEOUT")


def threads_per_rank():
    """TensorFlow threads per rank; None picks cores-per-node divided by ranks-per-node."""
    return int(_read_number("TNT_THREADS_PER_RANK")) or None


def bind_cores():
    """Each rank of a node runs on its own share of the node's cores, where nothing bound them yet."""
    return _flag("TNT_BIND_CORES", _default("TNT_BIND_CORES"))


def ring_allreduce():
    """Large gradient buckets use tarantella's ring allreduce unless TNT_ALLREDUCE=mpi."""
    choice = os.environ.get("TNT_ALLREDUCE", _default("TNT_ALLREDUCE")).strip().lower()
    if choice not in SETTINGS["TNT_ALLREDUCE"].choices:
        raise ValueError(f"TNT_ALLREDUCE={choice!r} must be 'ring' (large buckets in a ring over "
                         "MPI point-to-point) or 'mpi' (always MPI_Allreduce).")
    return choice == "ring"


def hierarchical_allreduce():
    """TNT_HIERARCHICAL_ALLREDUCE: 'auto', 'on' or 'off'."""
    choice = os.environ.get("TNT_HIERARCHICAL_ALLREDUCE", "").strip().lower() or _default("TNT_HIERARCHICAL_ALLREDUCE")
    if choice not in SETTINGS["TNT_HIERARCHICAL_ALLREDUCE"].choices:
        raise ValueError(f"TNT_HIERARCHICAL_ALLREDUCE={choice!r} must be 'on' (large gradient buckets summed within "
                         "each node first), 'off' (one ring over all ranks) or 'auto' (on where several nodes hold "
                         "several ranks each).")
    return choice


def gradient_wire():
    """TNT_GRADIENT_WIRE: 'auto', 'float32', 'bfloat16' or 'float16'."""
    return check_gradient_wire(os.environ.get("TNT_GRADIENT_WIRE", "").strip().lower() or
                               _default("TNT_GRADIENT_WIRE"), "TNT_GRADIENT_WIRE=")


def check_gradient_wire(choice, where):
    """`choice` where it names a gradient wire; else a ValueError naming `where` it came from."""
    if choice not in GRADIENT_WIRES:
        raise ValueError(f"{where}{choice!r} is not a gradient wire: use 'bfloat16' or 'float16' (half the bytes, "
                         "rounded once before sending), 'float32' (exact) or 'auto' (the variables' own type "
                         "where it is 16-bit, else float32).")
    return choice


def jax_gradient_handover():
    """'per-bucket', 'after-backprop', or 'auto' (the job's placement chooses, `backends.jax.gradient_sums`)."""
    choice = os.environ.get("TNT_JAX_GRADIENT_HANDOVER", "").strip().lower() or _default("TNT_JAX_GRADIENT_HANDOVER")
    if choice not in SETTINGS["TNT_JAX_GRADIENT_HANDOVER"].choices:
        raise ValueError(f"TNT_JAX_GRADIENT_HANDOVER={choice!r} must be 'auto', 'per-bucket' (each gradient bucket "
                         "summed as XLA computes it) or 'after-backprop' (all of them after backprop).")
    return choice


def output_on_all_devices():
    return _flag("TNT_OUTPUT_ON_ALL_DEVICES", _default("TNT_OUTPUT_ON_ALL_DEVICES"))


def tensorboard_on_all_devices():
    """TensorBoard writes one log folder per rank (rank_<r> inside its log_dir), not the master's only."""
    return _flag("TNT_TENSORBOARD_ON_ALL_DEVICES", _default("TNT_TENSORBOARD_ON_ALL_DEVICES"))


def save_on_signal():
    """The signal (a `signal.Signals`) on which every rank backs up at one step and stops, or None."""
    raw = os.environ.get("TNT_SAVE_ON_SIGNAL", "").strip().upper().removeprefix("SIG")
    if not raw:
        return None
    if raw not in SETTINGS["TNT_SAVE_ON_SIGNAL"].choices:
        raise ValueError(f"TNT_SAVE_ON_SIGNAL={os.environ['TNT_SAVE_ON_SIGNAL']!r} is not a signal tarantella saves "
                         "on; use USR1, USR2 or TERM (e.g. with #SBATCH --signal=B:USR1@120).")
    if backup_dir() is None:
        raise ValueError("TNT_SAVE_ON_SIGNAL needs a backup folder to save into: set TNT_BACKUP_DIR (the "
                         "tarantella command's --backup-dir).")
    return getattr(signal, "SIG" + raw)


def keep_child_processes():
    """Processes a rank's program left running outlive the rank (by default they are ended)."""
    return _flag("TNT_KEEP_CHILD_PROCESSES", _default("TNT_KEEP_CHILD_PROCESSES"))


def log_on_all_devices():
    return _flag("TNT_LOG_ON_ALL_DEVICES", _default("TNT_LOG_ON_ALL_DEVICES"))


def use_gpu():
    """False where the launcher runs every rank on CPU (--no-gpu, or fewer GPUs than ranks)."""
    return _flag("TNT_USE_GPU", _default("TNT_USE_GPU"))


def share_gpus():
    """Ranks of a node with fewer GPUs than ranks share them (rank r takes GPU r mod G), each taking
    GPU memory only as it needs it, instead of all training on CPU."""
    return _flag("TNT_SHARE_GPUS", _default("TNT_SHARE_GPUS"))


def announce_ranks():
    """Set by the `tarantella` command, which names a failed rank's host from these announcements."""
    return _flag("TNT_ANNOUNCE_RANKS", _default("TNT_ANNOUNCE_RANKS"))


def log_level():
    level = os.environ.get("TNT_LOG_LEVEL", _default("TNT_LOG_LEVEL")).strip().upper()
    if level not in SETTINGS["TNT_LOG_LEVEL"].choices:
        raise ValueError(f"TNT_LOG_LEVEL={level!r} is not one of DEBUG, INFO, WARNING, ERROR.")
    return level


def stall_warning_s():
    """After this many seconds in one collective, a waiting rank warns once, naming the missing ranks."""
    return _read_number("TNT_STALL_WARNING")


def start_timeout_s():
    """How long the `tarantella` command waits for every rank to start before it stops the job."""
    return _read_number("TNT_START_TIMEOUT")


def tensorflow_startup_logs():
    """The `tarantella` command shows TensorFlow's C++ start-up messages (oneDNN, CPU features)."""
    return _flag("TNT_TENSORFLOW_STARTUP_LOGS", _default("TNT_TENSORFLOW_STARTUP_LOGS"))


def timeline_path():
    """The trace file the master writes (`tarantella --timeline FILE`); None: no timeline."""
    path = os.environ.get("TNT_TIMELINE", "").strip()
    if not path:
        return _default("TNT_TIMELINE")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"TNT_TIMELINE={path!r}: the folder {folder} does not exist; create it or name a "
                         "file in an existing folder.")
    return path


def backup_dir():
    """Where `fit` backs up by itself (set by `tarantella --max-restarts`); None: no automatic backups."""
    value = os.environ.get("TNT_BACKUP_DIR", "").strip()
    return os.path.abspath(value) if value else _default("TNT_BACKUP_DIR")


def backup_every_steps():
    """With automatic backups, also back up after every this many steps; None: at epoch ends only."""
    raw = os.environ.get("TNT_BACKUP_EVERY_STEPS", "").strip()
    if not raw:
        return _default("TNT_BACKUP_EVERY_STEPS")
    if not raw.isdigit() or int(raw) < SETTINGS["TNT_BACKUP_EVERY_STEPS"].minimum:
        raise ValueError(f"TNT_BACKUP_EVERY_STEPS={raw!r} must be a whole number of steps >= 1, e.g. "
                         "TNT_BACKUP_EVERY_STEPS=100 (or unset it: backups at every epoch's end only).")
    return int(raw)


def restart_attempt():
    """Which attempt of the job this is: 0 for the first, k for the k-th restart (set by the command)."""
    raw = os.environ.get("TNT_RESTART_ATTEMPT", "").strip()
    if not raw:
        return _default("TNT_RESTART_ATTEMPT")
    if not raw.isdigit():
        raise ValueError(f"TNT_RESTART_ATTEMPT={raw!r} must be a whole number >= 0; the tarantella command "
                         "sets it when it restarts a job, so leave it unset.")
    return int(raw)


# The function that reads (and checks) each setting; TNT_MPIEXEC is read by the launcher (launcher/mpis).
_READERS = {
    "TNT_FUSION_THRESHOLD": fusion_threshold_bytes, "TNT_COLLECTIVE_TIMEOUT": collective_timeout_s,
    "TNT_THREADS_PER_RANK": threads_per_rank, "TNT_BIND_CORES": bind_cores, "TNT_ALLREDUCE": ring_allreduce,
    "TNT_JAX_GRADIENT_HANDOVER": jax_gradient_handover, "TNT_GRADIENT_WIRE": gradient_wire,
    "TNT_HIERARCHICAL_ALLREDUCE": hierarchical_allreduce,
    "TNT_OUTPUT_ON_ALL_DEVICES": output_on_all_devices, "TNT_TENSORBOARD_ON_ALL_DEVICES": tensorboard_on_all_devices,
    "TNT_LOG_ON_ALL_DEVICES": log_on_all_devices, "TNT_USE_GPU": use_gpu, "TNT_SHARE_GPUS": share_gpus,
    "TNT_ANNOUNCE_RANKS": announce_ranks,
    "TNT_LOG_LEVEL": log_level, "TNT_STALL_WARNING": stall_warning_s, "TNT_START_TIMEOUT": start_timeout_s,
    "TNT_TENSORFLOW_STARTUP_LOGS": tensorflow_startup_logs, "TNT_TIMELINE": timeline_path, "TNT_MPIEXEC": None,
    "TNT_BACKUP_DIR": backup_dir, "TNT_BACKUP_EVERY_STEPS": backup_every_steps,
    "TNT_RESTART_ATTEMPT": restart_attempt, "TNT_KEEP_CHILD_PROCESSES": keep_child_processes,
    "TNT_SAVE_ON_SIGNAL": save_on_signal,
}
assert set(_READERS) == set(SETTINGS), "every setting in SETTINGS has its reader, and no other"


def check_environment():
    """Reads every TNT_ setting, so that a bad value fails at once (ValueError naming it and the fix),
    and returns one warning per unknown TNT_ name that looks like a misspelt setting, naming it.
    (Unknown names close to no setting may be the user's own and are left alone.)"""
    for read in _READERS.values():
        if read is not None:
            read()
    warnings = []
    for name in sorted(os.environ):
        if name.startswith("TNT_") and name not in SETTINGS:
            closest = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.75)
            if closest:
                warnings.append(f"{name} is not a tarantella setting, so it is ignored; did you mean "
                                f"{closest[0]}? (docs/guide.md, Settings)")
    return warnings
