"""Intel MPI, with its Hydra mpiexec."""

import re

from tarantella.launcher.mpis.base import SSH_FIX, Ending
from tarantella.launcher.mpis.hydra import Hydra


class IntelMpi(Hydra):
    name = "Intel MPI"
    refusals = Hydra.refusals + [
        (r"Unable to run bstrap_proxy on (\S+)", r"ssh could not start its proxy on \1", SSH_FIX),
    ]

    @staticmethod
    def recognises(banner):
        return "Intel(R) MPI" in banner

    @staticmethod
    def endings(text):
        """'RANK 1 PID 7846 RUNNING AT node7' then 'KILLED BY SIGNAL: 9 (Killed)', for each rank it saw
        killed, including those it stopped itself; a rank that exited without finalizing is not named."""
        found = re.findall(r"RANK (\d+) PID (\d+) RUNNING AT (\S+)\s*=\s*KILLED BY SIGNAL: (\d+) \(([^)]*)\)", text)
        return [Ending(int(rank), host, pid, f"{name} (signal {number})") for rank, pid, host, number, name in found]
