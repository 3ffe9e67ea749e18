"""MPICH, with its Hydra mpiexec."""

import re

from tarantella.launcher.mpis.base import Ending
from tarantella.launcher.mpis.hydra import Hydra


class Mpich(Hydra):
    name = "MPICH"
    # Intel MPI's and MVAPICH's libraries, built on MPICH's, say it alike.
    abort_message = r"Abort\((?P<code>\d+)\) on node \d+ \(rank (?P<rank>\d+) in comm 0\)"

    @staticmethod
    def recognises(banner):
        return "HYDRA" in banner

    @staticmethod
    def endings(text):
        """'PID 123 RUNNING AT node7', 'EXIT CODE: 9' (the signal's number when it was killed), then
        'EXIT STRING: Killed (signal 9)'."""
        terminated = re.search(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)", text)
        if not terminated:
            return []
        pid, host, code = terminated.groups()
        how = re.search(r"EXIT STRING: (.+)", text)
        return [Ending(None, host, pid, how.group(1) if how else f"exit code {code}")]
