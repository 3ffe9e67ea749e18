"""Hydra, the mpiexec that MPICH, Intel MPI and MVAPICH share: what their flavours have in common."""

import re

from tarantella.launcher.mpis.base import SAME_PATH_FIX, SSH_FIX, MpiLauncher


class Hydra(MpiLauncher):
    srun_pmi_plugin = "pmi2"
    # What Hydra's refusals mean: (a pattern of its message, the cause, the fix).
    refusals = [
        (r"execvp error on file (\S+) \(([^)]*)\)", r"it could not run \1 (\2)", SAME_PATH_FIX),
        # ssh ends its lines with \r\n
        (r"ssh: ([^\r\n]*)\r?\n(?:.*\n)*?.*Launch proxy failed", r"ssh could not start its proxy on a host (\1)",
         SSH_FIX),
    ]

    def launch_command(self, placement, environment):
        command = self.mpiexec + _hosts(placement) + ["-n", str(placement.ranks)]
        for name, value in environment:
            command += ["-genv", name, value]
        return command

    def refusal(self, text):
        for pattern, cause, fix in self.refusals:
            match = re.search(pattern, text)
            if match:
                return f"{self.name}'s mpiexec could not start the job: {match.expand(cause)}. Fix: {fix}"
        return None


def _hosts(placement):
    """Intel MPI's Hydra ignores the slots in `-hosts` and fills the first host up to its cores
    before the next; `-ppn` (MPICH's Hydra knows it too) spreads the ranks evenly."""
    if not placement.hosts:
        return []
    return ["-hosts", placement.hosts_with_slots(), "-ppn", str(placement.ranks_per_node)]
