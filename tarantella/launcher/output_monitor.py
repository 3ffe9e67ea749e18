"""The output monitor of the `tarantella` command: it passes the ranks' output on, keeps their
reports (the stderr lines that carry this job's key) and what the MPI launcher says, and from
them tells when the job started, finished or failed, and which rank failed first, on which host."""

import os
import re
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from tarantella.common.rank_entry import (FAILED, FINISHED, OWN_FAILURE, RANK_ANNOUNCEMENT, SAVED, STARTED,
                                          UNKNOWN_CULPRIT)
from tarantella.launcher import mpis

FAILURE_GRACE_S = 3.0  # after a rank reported its failure, MPI gets this long to end the job itself
# After every rank finished and its process ended, the MPI launcher gets this long to end by itself;
# past it, only a process a rank started (and left running) holds the ranks' output open.
_ENDED_GRACE_S = 2.0
_REMOTE_ENDED_GRACE_S = 10.0  # ranks on other hosts: from their announcement, their end unseen
_PROXY_LOSS_CHECK_S = 0.2  # well within the time a rank that lost its proxy lives on (rank_entry)
_EXITING = 0x4  # PF_EXITING in the flags of /proc/PID/stat: the process is being torn down
# TensorFlow's C++ start-up messages (INFO lines in absl's format, and absl's banner) ignore
# TF_CPP_MIN_LOG_LEVEL; the command drops them unless TNT_TENSORFLOW_STARTUP_LOGS is true.
_TENSORFLOW_INFO_LINE = re.compile(r"I\d{4} \d+:\d+:\d+(?:\.\d+)?\s+\d+ [\w.]+:\d+\] ")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_CPU_FEATURES_CONTINUATION = "To enable the following instructions:"


@dataclass
class FailureReport:
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
class ProxyLoss:
    """A parent of ranks on this host (the MPI launcher's proxy) that ended while they ran."""
    name: str
    pid: int
    ranks: list
    at: float


class OutputMonitor:
    """Passes the ranks' output on unchanged, and keeps their reports (those carrying this job's
    key) and what the MPI launcher says, to name the rank whose failure came first."""

    _KEPT_CHARACTERS = 1 << 16

    def __init__(self, report_key, launcher_pid, mpi, hosts_expected=(), quiet_tensorflow=True):
        self._report_prefix = f"{RANK_ANNOUNCEMENT}{report_key} "
        self.launcher_pid = launcher_pid
        self.mpi = mpi  # the MpiLauncher of the launcher that runs the job
        self.hosts_expected = hosts_expected
        self.quiet_tensorflow = quiet_tensorflow
        self.started = {}  # rank -> host, from the rank's first report
        self.pids = {}  # rank -> pid
        self.finished = set()
        self.finished_at = {}  # rank -> when it announced the end of the program
        self.failed = []  # FailureReport, in the order they arrived
        self.saved = None  # what the master said when it backed up on the warning signal and stopped
        self._signal_for_ranks_to_come = None
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
        elif event == SAVED:
            self.saved = f"rank {rank} on host {host} " + " ".join(details)
        elif event == FAILED:
            error, culprit, summary = (details + ["an error", OWN_FAILURE, ""][len(details):])[:3]
            self.failed.append(FailureReport(rank, host, int(pid), error, culprit, summary, time.monotonic()))

    def _watch_here(self, rank, pid, parent):
        """Notes when a rank's process on this host ends (the first to end is the one that left),
        and when its parent (the MPI launcher's proxy) ends while it still runs."""
        try:
            handle = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return
        with self._lock:
            self._running_here[rank] = handle
            pending = self._signal_for_ranks_to_come
        if pending is not None:  # asked for before this rank started
            try:
                signal.pidfd_send_signal(handle, pending)
            except OSError:
                pass
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
            self.proxy_losses.append(ProxyLoss(name, pid, sorted(rank for rank, _ in ranks), time.monotonic()))

    def proxy_loss_settled(self, now):
        """True once a proxy on this host was lost and its ranks have ended since (they end
        themselves when their parent is gone), or a grace period passed."""
        return any(all(rank in self.ended_at for rank in loss.ranks) or now - loss.at > FAILURE_GRACE_S
                   for loss in self.proxy_losses)

    def signal_ranks_here(self, signum):
        """Sends `signum` to the ranks running on this host, and to those that start here later."""
        with self._lock:
            self._signal_for_ranks_to_come = signum
            handles = list(self._running_here.values())
        for handle in handles:
            try:
                signal.pidfd_send_signal(handle, signum)
            except OSError:  # it ended meanwhile
                pass

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
        for pattern in mpis.abort_messages():
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
        endings = mpis.endings_in(self.recent)
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
        return None if self.started else self.mpi.refusal(self.recent)


def _running_on(pid):
    """True while the process runs and is not being torn down (e.g. after SIGKILL)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _EXITING
