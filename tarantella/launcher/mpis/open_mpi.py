"""Open MPI, with its mpirun (Open MPI 4's orterun, Open MPI 5's prterun)."""

import os
import re

from tarantella.common.hardware import cores_here
from tarantella.launcher.mpis.base import SAME_PATH_FIX, SSH_FIX, Ending, MpiLauncher

# mpirun refuses to run as root (common in containers) unless both are set.
ROOT_PERMISSION = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
# What mpirun's own refusals mean for a tarantella user: (a pattern of its message, the fix).
_REFUSAL_FIXES = [
    (r"attempt to run as root", "run as another user, or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
                                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (the tarantella command sets them itself "
                                "when it runs as root)."),
    (r"not enough slots", "ask for fewer ranks (-n), list more hosts in the hostfile, or give each host "
                          "more slots; on one node the tarantella command lets Open MPI oversubscribe."),
    (r"(?i)unable to find the specified executable|could not\s+access", SAME_PATH_FIX),
    (r"(?i)unable to (reach|start a daemon)|daemon failed to report back|ssh|orted|prted", SSH_FIX),
]


class OpenMpi(MpiLauncher):
    name = "Open MPI"
    local_rank_variable = "OMPI_COMM_WORLD_LOCAL_RANK"
    srun_pmi_plugin = "pmix"  # Open MPI 5 speaks only PMIx
    abort_message = (r"MPI_ABORT was invoked on rank (?P<rank>\d+) in communicator MPI_COMM_WORLD\s+with "
                     r"errorcode (?P<code>\d+)")

    @staticmethod
    def recognises(banner):
        return "Open MPI" in banner or "OpenRTE" in banner or "prterun" in banner

    def launch_command(self, placement, environment):
        # Open MPI, unlike Hydra, passes almost no variable on by itself.
        command = self.mpiexec + (["--host", placement.hosts_with_slots()] if placement.hosts else [])
        if not placement.hosts and placement.ranks > cores_here():
            # Open MPI gives one slot per core and refuses more ranks; Hydra runs them anyway.
            command += self._oversubscription()
        command += ["-n", str(placement.ranks)]
        for name, value in environment:
            command += ["-x", f"{name}={value}"]
        return command

    def _oversubscription(self):
        """Open MPI 5 (prterun) deprecates --oversubscribe in favour of a mapping modifier."""
        match = re.search(r"\(Open MPI\) (\d+)\.", self.banner)
        if match and int(match.group(1)) >= 5:
            return ["--map-by", ":OVERSUBSCRIBE"]
        return ["--oversubscribe"]

    def rank_environment(self):
        return {name: "1" for name in ROOT_PERMISSION} if os.geteuid() == 0 else {}

    def notes(self, environment):
        if ROOT_PERMISSION[0] not in dict(environment):
            return []
        return ["running as root, so Open MPI's mpirun gets " + " ".join(f"{name}=1" for name in ROOT_PERMISSION)]

    @staticmethod
    def endings(text):
        """Its framed messages, wrapped at any word: '... process rank 1 with PID 8160 on node vm exited
        on signal 9 (Killed)', '... exiting improperly' (status 0 without finalizing MPI), and
        'Process name: [prterun-vm-27643@1,1]' with 'Exit code: 3'."""
        where = r"process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+(\S+)\s+"
        endings = [Ending(int(rank), host, pid, f"{name or 'signal'} (signal {number})")
                   for rank, pid, host, number, name
                   in re.findall(where + r"exited\s+on\s+signal\s+(\d+)(?:\s+\(([^)]*)\))?", text)]
        endings += [Ending(int(rank), host, pid, None)
                    for rank, pid, host in re.findall(where + r"exiting\s+improperly", text)]
        endings += [Ending(int(rank), "", "", f"exit status {code}")
                    for rank, code in re.findall(r"Process name: \[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)", text)]
        return endings

    def refusal(self, text):
        # Open MPI frames its own messages with lines of dashes; the first sentence says what is wrong.
        framed = re.search(r"^-{20,}\n(.*?)^-{20,}$", text, re.S | re.M)
        if not framed:
            return None
        paragraph = " ".join(framed.group(1).strip().split("\n\n")[0].split())
        cause = re.split(r"(?<=[a-z])\. ", paragraph)[0].rstrip(".:")
        for pattern, fix in _REFUSAL_FIXES:
            if re.search(pattern, framed.group(1)):
                break
        else:
            fix = "see mpirun's full message above."
        return f"{self.name}'s mpirun refused to start the job: {cause}. Fix: {fix}"
