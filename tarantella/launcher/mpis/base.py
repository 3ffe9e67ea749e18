"""What every MPI flavour module builds on: the interface of an MPI's launcher as the
`tarantella` command uses it, how that launcher says a rank ended, and the fixes that several
MPIs' refusals share."""

from dataclasses import dataclass

from tarantella.launcher.placement import Placement

SAME_PATH_FIX = "check that the program and the Python interpreter exist on every host at the same path."
SSH_FIX = "check that `ssh HOST true` works for every host without a password, and that the MPI is installed " \
          "at the same path there."


@dataclass
class Ending:
    """A rank that ended badly, as the MPI launcher reports it."""
    rank: object  # None where the MPI names only the process id
    host: str  # "" where the MPI does not name it
    pid: str  # "" likewise
    how: object  # e.g. "Killed (signal 9)"; None: it ended with status 0 without finalizing MPI


class MpiLauncher:
    """An MPI's launcher (mpiexec, mpirun, srun): one subclass per flavour, in a module of its own
    and listed in `tarantella.launcher.mpis.FLAVOURS`. A subclass defines `recognises` and
    `launch_command`; the rest has defaults that suit an MPI with nothing to say about them."""

    name = "the MPI"  # as its users call it, in the command's messages
    # Where each rank finds its index on its node (to pin it): Hydra's, and the guess for an unknown MPI.
    local_rank_variable = "MPI_LOCALRANKID"
    srun_pmi_plugin = None  # srun's --mpi plug-in through which ranks of this MPI's library meet
    # The MPI library's message when a rank calls MPI_Abort: a pattern with the groups rank and code.
    abort_message = None

    def __init__(self, mpiexec, banner, mpi_of_the_library):
        self.mpiexec = list(mpiexec)
        self.banner = banner  # what `mpiexec --version` printed
        # Gives the MpiLauncher of the MPI that mpi4py loads, or None: srun serves any MPI and
        # must choose the PMI plug-in of that one.
        self.mpi_of_the_library = mpi_of_the_library

    @staticmethod
    def recognises(banner):
        """Whether `banner`, the output of `mpiexec --version`, is this flavour's."""
        raise NotImplementedError

    def launch_command(self, placement, environment):
        """The launcher's command line, up to what each rank runs: the hosts and ranks of `placement`,
        and the variables `environment` (name and value pairs, in order) on every rank."""
        raise NotImplementedError

    def one_process_per_host(self, hosts):
        """The launcher's command line, up to what runs, for one process on each host (--cleanup)."""
        return self.launch_command(Placement(hosts, ranks_per_node=1, use_gpu=False, warnings=[]), [])

    def rank_environment(self):
        """Variables the launcher itself needs, set where the user did not set them."""
        return {}

    def notes(self, environment):
        """INFO lines about what the command gives the launcher, for the variables `environment`."""
        return []

    @staticmethod
    def endings(text):
        """The `Ending`s of the ranks that the launcher says, in its output `text`, ended badly."""
        return []

    def refusal(self, text):
        """One line naming the MPI, the cause and the fix, when `text` is the launcher refusing to
        start the job with a message this flavour knows; else None."""
        return None
