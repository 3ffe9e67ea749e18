"""Slurm's srun as the MPI launcher: the ranks of any MPI meet through one of Slurm's PMI plug-ins."""

import os
import re
import shutil
import subprocess

from tarantella.launcher.mpis.base import MpiLauncher


class Srun(MpiLauncher):
    local_rank_variable = "SLURM_LOCALID"

    @staticmethod
    def recognises(banner):
        return banner.startswith("slurm")

    def launch_command(self, placement, environment):
        command = self.mpiexec + [f"--ntasks={placement.ranks}", f"--ntasks-per-node={placement.ranks_per_node}",
                                  "--kill-on-bad-exit=1"]
        if placement.hosts:
            command += [f"--nodes={len(placement.hosts)}", "--nodelist=" + ",".join(placement.hosts)]
        command += self._pmi_option()
        # srun's --export cannot carry values with commas; env can carry anything.
        return command + ["env"] + [f"{name}={value}" for name, value in environment]

    def one_process_per_host(self, hosts):
        return self.mpiexec + [f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                               "--nodelist=" + ",".join(hosts)]

    def _pmi_option(self):
        """srun's `--mpi=PLUGIN` for the MPI that mpi4py loads, when nothing else chose one: neither the
        srun command (TNT_MPIEXEC), SLURM_MPI_TYPE nor the cluster (MpiDefault). With Slurm's own
        default, none, MPI cannot find the other tasks and each rank would train alone, as a job of
        size 1."""
        if any(word == "--mpi" or word.startswith("--mpi=") for word in self.mpiexec) or \
                os.environ.get("SLURM_MPI_TYPE"):
            return []
        if _slurm_mpi_default(self.mpiexec) not in (None, "none"):
            return []
        library = self.mpi_of_the_library()
        plugin = library.srun_pmi_plugin if library else None
        return [f"--mpi={plugin}"] if plugin else []


def _slurm_mpi_default(srun):
    """The cluster's MpiDefault (`scontrol show config`, found beside srun first), or None."""
    beside_srun = os.path.join(os.path.dirname(shutil.which(srun[0]) or ""), "scontrol")
    scontrol = beside_srun if os.access(beside_srun, os.X_OK) else "scontrol"
    try:
        listing = subprocess.run([scontrol, "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^MpiDefault\s*=\s*(\S+)", listing, re.M)
    return match.group(1) if match else None
