"""An MPI launcher that no flavour module recognises."""

import shlex

from tarantella.launcher.messages import LaunchError
from tarantella.launcher.mpis.base import MpiLauncher


class UnknownMpi(MpiLauncher):
    """Runs the ranks on this node only, where they inherit the variables from the command."""

    @staticmethod
    def recognises(banner):
        return False

    def launch_command(self, placement, environment):
        if placement.hosts:
            raise LaunchError(f"{shlex.join(self.mpiexec)} is neither Hydra (MPICH, Intel MPI, MVAPICH), Open MPI "
                              "nor srun, so tarantella cannot tell it the hosts. Name a known launcher with "
                              "TNT_MPIEXEC, or run it yourself (see docs/running.md).")
        return self.mpiexec + ["-n", str(placement.ranks)]

    def one_process_per_host(self, hosts):
        raise LaunchError(f"{shlex.join(self.mpiexec)} is an unknown MPI launcher, so --cleanup cannot reach the "
                          "hosts. Name mpiexec, mpirun or srun with TNT_MPIEXEC.")
