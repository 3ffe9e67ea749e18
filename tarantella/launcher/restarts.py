"""`tarantella --max-restarts K` and `--save-on-signal`: a job whose rank fails is stopped as always, then
started again, up to K times; each attempt resumes from the last complete backup (tarantella/backups.py).

Every attempt is the `tarantella` command itself, run as a child with the same arguments
and TNT_RESTART_ATTEMPT set, so it places, starts, watches and stops the ranks exactly as a
job without restarts (any MPI, hostfiles, Slurm). This command passes the attempt's standard
error on, reads the attempt's last line (why it failed), and decides:
- status 0: the job ended well; the backups are removed;
- status 75 (`--save-on-signal`: the ranks backed up on the cluster's warning and stopped): no
  restart, the backup stays for the next run;
- a refused command line (`tarantella: error: ...`), Ctrl+C, SIGTERM or SIGHUP: no restart;
- otherwise, restarts left: one line (attempt, cause, where it resumes), and the next attempt.
With --min-ranks, each restart first asks every host of the job to run `true` through the MPI
launcher, and leaves out those that do not answer, while at least M ranks remain.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tarantella.common import backup_files, config, hardware
from tarantella.common.child_processes import end_with_parent
from tarantella.launcher import placement
from tarantella.launcher.messages import LaunchError

_FAILURE = re.compile(r"tarantella: the job failed \(exit status (\d+)\): (.*)")
_REFUSAL = "tarantella: error: "
_DEFAULT_FOLDER = "tarantella-backups"
_PROBE_STOP_GRACE_S = 3.0
_HOST_LISTS = "tarantella-hosts-"
_ATTEMPT_LISTENS_AFTER_S = 3.0  # an attempt listens for the warning signal this long after it started  # a folder in the backup folder: the hostfiles of attempts on fewer hosts


def add_options(parser):
    group = parser.add_argument_group("long jobs (docs/running.md, Long jobs)")
    group.add_argument("--max-restarts", type=_whole_number(0), metavar="K",
                       help="when a rank fails, stop the job and start it again, up to K times, resuming "
                            "from the last complete backup; fit backs up by itself unless the program has "
                            "its own BackupAndRestore")
    group.add_argument("--backup-dir", metavar="DIR",
                       help="folder of the automatic backups, visible to every rank (default: "
                            f"./{_DEFAULT_FOLDER}/<program>-<Slurm job id, or date and process id>); an "
                            "existing backup there is resumed from")
    group.add_argument("--backup-every-steps", type=_whole_number(1), metavar="N",
                       help="also back up after every N steps (default: at every epoch's end only)")
    group.add_argument("--save-on-signal", metavar="SIGNAL", type=_signal_name,
                       help="the cluster's warning before walltime or preemption (USR1, USR2 or TERM; e.g. "
                            "#SBATCH --signal=B:USR1@120): every rank stops at one step, the master backs up, "
                            f"and the job exits with status {config.SAVED_AND_STOPPED_STATUS}; the same command "
                            "resumes")
    group.add_argument("--requeue", action="store_true",
                       help="with --save-on-signal, in a Slurm batch job: after the save, put the job back in "
                            "the queue (scontrol requeue; the job must be requeueable, #SBATCH --requeue), so "
                            "that it resumes when it runs again")
    group.add_argument("--min-ranks", type=_whole_number(1), metavar="M",
                       help="with a hostfile or Slurm: at a restart, leave out hosts that do not answer and "
                            "go on with the others while at least M ranks remain")


def check_options(parser, options):
    needing = [flag for flag, value in (("--backup-dir", options.backup_dir),
                                        ("--backup-every-steps", options.backup_every_steps),
                                        ("--min-ranks", options.min_ranks)) if value is not None]
    if needing and options.max_restarts is None and options.save_on_signal is None:
        parser.error(f"{needing[0]} only goes with --max-restarts or --save-on-signal, e.g. tarantella "
                     f"--max-restarts 3 {needing[0]} ... -- train.py")
    if options.requeue and options.save_on_signal is None:
        parser.error("--requeue only goes with --save-on-signal, e.g. tarantella --save-on-signal USR1 --requeue "
                     "-- train.py")


def supervises(options):
    """Whether this command runs the attempts: --max-restarts or --save-on-signal, and not itself an
    attempt."""
    return ((options.max_restarts is not None or options.save_on_signal is not None)
            and "TNT_RESTART_ATTEMPT" not in os.environ)


def main(argv, options):
    split = argv.index("--")
    own, program = argv[:split], argv[split:]
    directory = os.path.abspath(options.backup_dir or _default_directory(program[1]))
    environment = {"TNT_BACKUP_DIR": directory}
    if options.backup_every_steps:
        environment["TNT_BACKUP_EVERY_STEPS"] = str(options.backup_every_steps)
    if options.save_on_signal:
        environment["TNT_SAVE_ON_SIGNAL"] = options.save_on_signal
    max_restarts = options.max_restarts or 0
    attempts = _Attempts(own, program, environment, options.save_on_signal)
    if options.dry_run or options.cleanup:
        return attempts.run(0)[0]
    hosts, per_node = [], None
    if options.min_ranks is not None:
        try:
            hosts, per_node = _hosts_and_ranks_per_node(options)
        except ValueError as error:
            _say(f"tarantella: error: {error}")
            return 2
    os.makedirs(directory, exist_ok=True)
    _remove_partial_backups(directory)
    if backup_files.latest(directory):
        _say(f"tarantella: {directory} holds backups: the job resumes from {_where(directory)}.")
    attempts.catch_signals()
    reachable = hosts
    for attempt in range(max_restarts + 1):
        extra = [] if reachable == hosts else attempts.on_hosts(reachable, per_node, directory, attempt)
        status, cause, refused = attempts.run(attempt, extra)
        if status == 0:
            _remove_backups(directory, default=options.backup_dir is None)
            return 0
        if status == config.SAVED_AND_STOPPED_STATUS:
            if options.requeue:
                _requeue()
            return status  # the cluster ends the job: the backup stays for the next run, nothing restarts
        if attempts.interrupted or refused:
            break
        if attempt == max_restarts:
            if max_restarts:
                _say(f"tarantella: no restart left (--max-restarts {max_restarts}); the job failed "
                     f"(exit status {status}): {cause}")
            break
        _remove_partial_backups(directory)
        left_out = ""
        if hosts:
            reachable = attempts.answering(hosts)
            if attempts.interrupted:
                break
            if len(reachable) * per_node < options.min_ranks:
                _say(f"tarantella: cannot restart: the hosts that answer ({', '.join(reachable) or 'none'}) hold "
                     f"{len(reachable) * per_node} ranks, fewer than --min-ranks {options.min_ranks}; the job "
                     f"failed (exit status {status}): {cause}")
                break
            missing = [host for host in hosts if host not in reachable]
            if missing:
                left_out = (f" on {len(reachable) * per_node} ranks ({per_node} on each of {', '.join(reachable)}; "
                            f"left out, not answering: {', '.join(missing)})")
        _say(f"tarantella: restart {attempt + 1} of {max_restarts} after the job failed (exit status "
             f"{status}): {cause} Resuming from {_where(directory)}{left_out}.")
    _remove_host_lists(directory)
    _remove_empty_folders(directory, default=options.backup_dir is None)  # backups stay, for a later run
    return status


class _Attempts:
    """Runs the job's attempts as children of this command, passing their standard error on."""

    def __init__(self, own, program, environment, save_signal=None):
        self.own, self.program, self.environment = own, program, environment
        self.save_signal = None if save_signal is None else getattr(signal, "SIG" + save_signal)
        self.child = None
        self.interrupted = None
        self._save_requested = False
        self._child_started = 0.0
        self._scratch = None

    def _prepare_child(self):
        end_with_parent()
        if self.save_signal is not None:
            # Until the attempt listens for the warning (as it starts), the warning must not end it.
            signal.signal(self.save_signal, signal.SIG_IGN)

    def catch_signals(self):
        def forward(signum, _frame):
            child = self.child
            if signum == self.save_signal and not self._save_requested:
                self._save_requested = True  # the attempt has its ranks save and stop; a second one stops
                if child is not None and time.monotonic() - self._child_started < _ATTEMPT_LISTENS_AFTER_S:
                    # Ignored by an attempt that does not listen yet: passed on once it does.
                    delay = _ATTEMPT_LISTENS_AFTER_S - (time.monotonic() - self._child_started)
                    threading.Timer(delay, _signal_if_running, args=(child, signum)).start()
                    return
            else:
                self.interrupted = signum
            if child is not None and child.poll() is None:
                child.send_signal(signum)  # the attempt stops its ranks and says so
        for signum in {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} | ({self.save_signal} - {None}):
            signal.signal(signum, forward)

    def run(self, attempt, extra=()):
        """(exit status, cause of failure, whether the command line was refused) of one attempt."""
        if self.interrupted:
            return 128 + self.interrupted, "", True
        env = dict(os.environ, **self.environment, TNT_RESTART_ATTEMPT=str(attempt))
        command = [sys.executable, "-m", "tarantella.launcher", *self.own, *extra, *self.program]
        self.child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, preexec_fn=self._prepare_child)
        self._child_started = time.monotonic()
        last = [""]
        reader = threading.Thread(target=_pass_on, args=(self.child.stderr, last), daemon=True)
        reader.start()
        status = self.child.wait()
        reader.join(timeout=5)
        line = last[0]
        if self.interrupted and status == 0:
            status = 128 + self.interrupted
        status = 128 - status if status < 0 else status
        failure = _FAILURE.fullmatch(line)
        cause = failure.group(2) if failure else (line[len("tarantella: "):] if line else
                                                  "see the messages above.")
        return status, cause, line.startswith(_REFUSAL)

    def on_hosts(self, hosts, per_node, directory, attempt):
        """Arguments that run the next attempt on `hosts` only (later ones win in the command line)."""
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix=_HOST_LISTS, dir=directory)
        hostfile = os.path.join(self._scratch, f"attempt-{attempt}")
        with open(hostfile, "w") as file:
            file.write("\n".join(hosts) + "\n")
        return ["--hostfile", hostfile, "-n", str(per_node * len(hosts)), "--n-per-node", str(per_node)]

    def answering(self, hosts):
        """The hosts on which the MPI launcher starts `true` within TNT_START_TIMEOUT."""
        timeout_s = config.start_timeout_s()
        probes = {}
        with tempfile.TemporaryDirectory(prefix="tarantella-probe-") as folder:
            for host in hosts:
                hostfile = os.path.join(folder, re.sub(r"[^\w.-]", "_", host))
                with open(hostfile, "w") as file:
                    file.write(host + "\n")
                probes[host] = subprocess.Popen(
                    [sys.executable, "-m", "tarantella.launcher", "--hostfile", hostfile, "-n", "1", "--no-gpu",
                     "--log-level", "ERROR", "--", "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env=dict(os.environ, **self.environment), start_new_session=True, preexec_fn=end_with_parent)
            deadline = time.monotonic() + timeout_s
            answering = []
            for host, probe in probes.items():
                try:
                    if probe.wait(timeout=max(0.0, deadline - time.monotonic())) == 0:
                        answering.append(host)
                except subprocess.TimeoutExpired:
                    _stop(probe)
        return answering


def _pass_on(stream, last):
    """Copies the attempt's standard error to ours as it comes (a line without its end too),
    keeping the last of the command's own lines."""
    pending = b""
    while chunk := os.read(stream.fileno(), 1 << 16):
        try:
            os.write(2, chunk)
        except OSError:  # closed: the attempt's output is still read, or it would block
            pass
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith("tarantella: ") and not text.startswith("tarantella: WARNING"):
                last[0] = text


def _where(directory):
    found = backup_files.latest(directory)
    if found is None:
        return "the start (no complete backup yet)"
    number, header = found
    written = time.strftime("%H:%M:%S", time.localtime(header.get("written_at", 0)))
    if header["completed"]:
        return f"the end of fit #{number} (complete; backup of {written} in {directory})"
    return (f"fit #{number} at epoch {header['epoch'] + 1}, step {header['step']} (backup of {written} in "
            f"{directory})")


def _default_directory(program):
    stem = os.path.splitext(os.path.basename(program))[0] or "job"
    job = os.environ.get("SLURM_JOB_ID")
    name = f"{stem}-slurm{job}" if job else f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return os.path.join(_DEFAULT_FOLDER, name)


def _hosts_and_ranks_per_node(options):
    if options.hostfile:
        hosts = placement.read_hostfile(options.hostfile)
    else:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        hosts = placement.expand_slurm_nodelist(nodelist) if nodelist else []
    if not hosts:
        raise ValueError("--min-ranks leaves out hosts that do not answer, so it needs several: give them with "
                         "--hostfile, or run inside a Slurm allocation.")
    try:
        ranks = placement.place_ranks(options, hosts, hardware.count_gpus())
    except LaunchError as error:
        raise ValueError(str(error)) from None
    if options.min_ranks > ranks.ranks:
        raise ValueError(f"--min-ranks {options.min_ranks} is more than the job's {ranks.ranks} ranks. Give "
                         f"at most {ranks.ranks}.")
    return hosts, ranks.ranks_per_node


def _remove_partial_backups(directory):
    """What a writer killed mid-backup left (every rank of the last attempt has ended)."""
    for entry in os.listdir(directory):
        if entry.startswith(backup_files.PARTIAL_PREFIX) and backup_files.is_ours(entry):
            _remove_quietly(os.path.join(directory, entry))


def _remove_backups(directory, default):
    """After a good end: tarantella's own files only, then the folders if that left them empty."""
    for entry in os.listdir(directory):
        if backup_files.is_ours(entry):
            _remove_quietly(os.path.join(directory, entry))
    _remove_host_lists(directory)
    _remove_empty_folders(directory, default)


def _remove_host_lists(directory):
    """The hostfiles of attempts on fewer hosts."""
    for entry in os.listdir(directory):
        folder = os.path.join(directory, entry)
        if entry.startswith(_HOST_LISTS) and os.path.isdir(folder):
            for name in os.listdir(folder):
                if name.startswith("attempt-"):
                    _remove_quietly(os.path.join(folder, name))
            try:
                os.rmdir(folder)
            except OSError:
                pass


def _remove_empty_folders(directory, default):
    for folder in (directory, os.path.dirname(directory)) if default else (directory,):
        try:
            os.rmdir(folder)
        except OSError:  # not empty: a backup, or something of the user's
            pass


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _stop(process):
    for signum, grace in ((signal.SIGTERM, _PROBE_STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass


def _signal_if_running(child, signum):
    if child.poll() is None:
        child.send_signal(signum)


def _requeue():
    """Puts this Slurm batch job back in the queue; it resumes from its backup when it runs again."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        _say("tarantella: WARNING: --requeue: this is no Slurm job, so nothing is requeued; run the same command "
             "again to resume.")
        return
    # Said first: Slurm ends the running job as it requeues it.
    _say(f"tarantella: requeueing Slurm job {job}; it resumes from the backup when it runs again.")
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        _say(f"tarantella: WARNING: scontrol requeue {job} failed ({error}); submit the job again to resume.")
        return
    if done.returncode != 0:
        _say(f"tarantella: WARNING: scontrol requeue {job} failed: {(done.stderr or done.stdout).strip()}. The job "
             "must be requeueable (#SBATCH --requeue); submit it again to resume.")


def _signal_name(text):
    name = text.strip().upper().removeprefix("SIG")
    if name not in config.SETTINGS["TNT_SAVE_ON_SIGNAL"].choices:
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal tarantella saves on; use USR1, USR2 or TERM")
    return name


def _whole_number(minimum):
    def parse(text):
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expects a whole number >= {minimum}, got {text!r}")
        return int(text)
    return parse


def _say(line):
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass

