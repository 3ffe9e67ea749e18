"""The MPI flavours the `tarantella` command knows, one module each, and the one registry that
finds the MPI launcher and tells its flavour from its version banner. A new flavour is a module
with a subclass of `base.MpiLauncher` (docs/architecture.md says what it defines) and its line
in FLAVOURS."""

import functools
import os
import shlex
import shutil
import subprocess
import sys

from tarantella.launcher.messages import LaunchError
from tarantella.launcher.mpis.intel_mpi import IntelMpi
from tarantella.launcher.mpis.mpich import Mpich
from tarantella.launcher.mpis.mvapich import Mvapich
from tarantella.launcher.mpis.open_mpi import OpenMpi
from tarantella.launcher.mpis.srun import Srun
from tarantella.launcher.mpis.unknown import UnknownMpi

# The first whose `recognises` accepts the banner is the flavour: a flavour before the one it
# builds on, whose banner marker its own banner holds too.
FLAVOURS = [IntelMpi, Mvapich, Mpich, OpenMpi, Srun]


def find_mpiexec():
    """The MPI launcher's command: TNT_MPIEXEC, else the launcher of the MPI that mpi4py loads."""
    configured = os.environ.get("TNT_MPIEXEC")
    if configured:
        command = shlex.split(configured)
        if not shutil.which(command[0]):
            raise LaunchError(f"TNT_MPIEXEC={configured!r} names {command[0]!r}, which is not an executable "
                              "program (nor on PATH). Fix TNT_MPIEXEC, or unset it to use mpiexec.")
        return command
    found = launcher_of_the_mpi_library()
    if found:
        return [found]
    raise LaunchError("no mpiexec found. Install an MPI (e.g. pip install 'tarantella[mpich]'), put your "
                      "MPI's bin directory on PATH, or name the launcher with TNT_MPIEXEC.")


def launcher_of_the_mpi_library():
    """The mpiexec that comes with the MPI mpi4py loads, or None."""
    # The `mpich` wheel installs mpiexec beside the interpreter, which need not be on PATH.
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside_python, os.X_OK):
        return beside_python
    return shutil.which("mpiexec") or shutil.which("mpirun")


def identify(mpiexec):
    """The MpiLauncher of the command `mpiexec`, of its flavour (UnknownMpi where none recognises it)."""
    banner = _version_banner(tuple(mpiexec))
    flavour = next((flavour for flavour in FLAVOURS if flavour.recognises(banner)), UnknownMpi)
    return flavour(mpiexec, banner, _mpi_of_the_library)


def _mpi_of_the_library():
    found = launcher_of_the_mpi_library()
    return identify([found]) if found else None


@functools.lru_cache(maxsize=None)
def _version_banner(mpiexec):
    try:
        return subprocess.run(list(mpiexec) + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def endings_in(text):
    """The ranks that ended badly, as whichever known MPI's launcher says so in its output `text`."""
    readers = dict.fromkeys(flavour.endings for flavour in FLAVOURS)  # flavours may share one
    return [ending for read in readers for ending in read(text)]


def abort_messages():
    """Every known MPI library's pattern of its message when a rank calls MPI_Abort."""
    return list(dict.fromkeys(flavour.abort_message for flavour in FLAVOURS if flavour.abort_message))
