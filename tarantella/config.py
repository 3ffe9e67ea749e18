"""Settings read from the environment (the launcher sets them; users may too)."""

import difflib
import math
import os

DEFAULT_FUSION_THRESHOLD_KB = 32
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
DEFAULT_STALL_WARNING_S = 60.0
DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_SHUFFLE_SEED = 42

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(name, default=False):
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
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a number of {unit}; set it to a number >= {minimum:g}, "
            f"e.g. {name}={default:g}.") from None
    if not math.isfinite(value):  # nan compares false with everything: it would disable the limit
        raise ValueError(f"{name}={raw!r} must be a finite number of {unit} >= {minimum:g}, e.g. "
                         f"{name}={default:g}.")
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum:g} {unit}.")
    return value


def fusion_threshold_bytes():
    """Minimum size of one fused gradient allreduce; 0 sends every gradient on its own."""
    kilobytes = _number("TNT_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD_KB, 0, "kilobytes")
    return int(kilobytes * 1024)


def collective_timeout_s():
    """How long a rank waits for the others in one collective before it gives up."""
    return _number("TNT_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S, 1, "seconds")


def threads_per_rank():
    """TensorFlow threads per rank; None picks cores-per-node divided by ranks-per-node."""
    value = _number("TNT_THREADS_PER_RANK", 0, 0, "threads")
    return int(value) or None


def bind_cores():
    """Each rank of a node runs on its own share of the node's cores, where nothing bound them yet."""
    return _flag("TNT_BIND_CORES", default=True)


def ring_allreduce():
    """Large gradient buckets use tarantella's ring allreduce unless TNT_ALLREDUCE=mpi."""
    choice = os.environ.get("TNT_ALLREDUCE", "ring").strip().lower()
    if choice not in {"ring", "mpi"}:
        raise ValueError(f"TNT_ALLREDUCE={choice!r} must be 'ring' (large buckets in a ring over "
                         "MPI point-to-point) or 'mpi' (always MPI_Allreduce).")
    return choice == "ring"


def output_on_all_devices():
    return _flag("TNT_OUTPUT_ON_ALL_DEVICES")


def tensorboard_on_all_devices():
    """TensorBoard writes one log folder per rank (rank_<r> inside its log_dir), not the master's only."""
    return _flag("TNT_TENSORBOARD_ON_ALL_DEVICES")


def log_on_all_devices():
    return _flag("TNT_LOG_ON_ALL_DEVICES")


def use_gpu():
    """False where the launcher runs every rank on CPU (--no-gpu, or fewer GPUs than ranks)."""
    return _flag("TNT_USE_GPU", default=True)


def share_gpus():
    """Ranks of a node with fewer GPUs than ranks share them (rank r takes GPU r mod G), each taking
    GPU memory only as it needs it, instead of all training on CPU."""
    return _flag("TNT_SHARE_GPUS")


def announce_ranks():
    """Set by the `tarantella` command, which names a failed rank's host from these announcements."""
    return _flag("TNT_ANNOUNCE_RANKS")


def log_level():
    level = os.environ.get("TNT_LOG_LEVEL", "WARNING").strip().upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError(f"TNT_LOG_LEVEL={level!r} is not one of DEBUG, INFO, WARNING, ERROR.")
    return level


def stall_warning_s():
    """After this many seconds in one collective, a waiting rank warns once, naming the missing ranks."""
    return _number("TNT_STALL_WARNING", DEFAULT_STALL_WARNING_S, 1, "seconds")


def start_timeout_s():
    """How long the `tarantella` command waits for every rank to start before it stops the job."""
    return _number("TNT_START_TIMEOUT", DEFAULT_START_TIMEOUT_S, 1, "seconds")


def tensorflow_startup_logs():
    """The `tarantella` command shows TensorFlow's C++ start-up messages (oneDNN, CPU features)."""
    return _flag("TNT_TENSORFLOW_STARTUP_LOGS")


def timeline_path():
    """The trace file the master writes (`tarantella --timeline FILE`); None: no timeline."""
    path = os.environ.get("TNT_TIMELINE", "").strip()
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"TNT_TIMELINE={path!r}: the folder {folder} does not exist; create it or name a "
                         "file in an existing folder.")
    return path


def backup_dir():
    """Where `fit` backs up by itself (set by `tarantella --max-restarts`); None: no automatic backups."""
    value = os.environ.get("TNT_BACKUP_DIR", "").strip()
    return os.path.abspath(value) if value else None


def backup_every_steps():
    """With automatic backups, also back up after every this many steps; None: at epoch ends only."""
    raw = os.environ.get("TNT_BACKUP_EVERY_STEPS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TNT_BACKUP_EVERY_STEPS={raw!r} must be a whole number of steps >= 1, e.g. "
                         "TNT_BACKUP_EVERY_STEPS=100 (or unset it: backups at every epoch's end only).")
    return int(raw)


def restart_attempt():
    """Which attempt of the job this is: 0 for the first, k for the k-th restart (set by the command)."""
    raw = os.environ.get("TNT_RESTART_ATTEMPT", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"TNT_RESTART_ATTEMPT={raw!r} must be a whole number >= 0; the tarantella command "
                         "sets it when it restarts a job, so leave it unset.")
    return int(raw)


# Every setting a user may give, with the function that reads (and checks) it; None: read elsewhere.
_SETTINGS = {
    "TNT_FUSION_THRESHOLD": fusion_threshold_bytes, "TNT_COLLECTIVE_TIMEOUT": collective_timeout_s,
    "TNT_THREADS_PER_RANK": threads_per_rank, "TNT_BIND_CORES": bind_cores, "TNT_ALLREDUCE": ring_allreduce,
    "TNT_OUTPUT_ON_ALL_DEVICES": output_on_all_devices, "TNT_TENSORBOARD_ON_ALL_DEVICES": tensorboard_on_all_devices,
    "TNT_LOG_ON_ALL_DEVICES": log_on_all_devices, "TNT_USE_GPU": use_gpu, "TNT_SHARE_GPUS": share_gpus,
    "TNT_ANNOUNCE_RANKS": announce_ranks,
    "TNT_LOG_LEVEL": log_level, "TNT_STALL_WARNING": stall_warning_s, "TNT_START_TIMEOUT": start_timeout_s,
    "TNT_TENSORFLOW_STARTUP_LOGS": tensorflow_startup_logs, "TNT_TIMELINE": timeline_path, "TNT_MPIEXEC": None,
    "TNT_BACKUP_DIR": backup_dir, "TNT_BACKUP_EVERY_STEPS": backup_every_steps,
    "TNT_RESTART_ATTEMPT": restart_attempt,
}


def check_environment():
    """Reads every TNT_ setting, so that a bad value fails at once (ValueError naming it and the fix),
    and returns one warning per unknown TNT_ name that looks like a misspelt setting, naming it.
    (Unknown names close to no setting may be the user's own and are left alone.)"""
    for read in _SETTINGS.values():
        if read is not None:
            read()
    warnings = []
    for name in sorted(os.environ):
        if name.startswith("TNT_") and name not in _SETTINGS:
            closest = difflib.get_close_matches(name, _SETTINGS, n=1, cutoff=0.75)
            if closest:
                warnings.append(f"{name} is not a tarantella setting, so it is ignored; did you mean "
                                f"{closest[0]}? (docs/guide.md, Settings)")
    return warnings
