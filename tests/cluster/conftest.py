"""The MPIs the cluster tests run, each in a venv of its own (mpi4py takes the first MPI library
it finds, so two MPI wheels cannot share one): MPICH in the suite's own venv, Open MPI 5 and Intel
MPI from PyPI and Open MPI 4.1 from Debian's packages (unpacked into the venv, not installed) in
REPO/.venv-<mpi>-tests, made once and then reused. And a throwaway unprivileged user, for runs
that must not be root.
"""

import dataclasses
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, load_npz, quiet_env

REPO = pathlib.Path(__file__).resolve().parents[2]
ALL_TESTS = bool(os.environ.get("TNT_CLUSTER_TESTS"))
TRAIN = WORKERS / "train_cases.py"
CASE = "mlp-batch71"  # global batches of 71 and 64 samples: split unevenly over 2 or 3 ranks


@dataclasses.dataclass(frozen=True)
class Mpi:
    name: str  # as the launcher's messages call it
    venv: pathlib.Path
    launcher: str  # the MPI's own launcher, relative to the venv
    banner: str  # what `launcher --version` says
    pip_extra: str = ""  # what the venv installs besides this checkout with [cpu]
    debian_packages: tuple = ()  # unpacked into the venv's debian/ (not installed on the system)

    def bin(self, program):
        return self.venv / "bin" / program

    @property
    def launcher_path(self):
        return self.venv / self.launcher

    @property
    def launcher_name(self):
        return "mpirun" if "mpirun" in self.launcher else "mpiexec"

    def env(self):
        """What a user sets to use this MPI: nothing for a wheel's; for the unpacked Debian
        packages, where they are and which mpirun the command runs."""
        if not self.debian_packages:
            return {}
        root = self.venv / "debian"
        libraries = ["usr/lib/x86_64-linux-gnu/openmpi/lib", "usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu",
                     "usr/lib/libpsm1"]
        return {"OPAL_PREFIX": str(root / "usr"), "TNT_MPIEXEC": str(self.launcher_path),
                "LD_LIBRARY_PATH": ":".join(str(root / folder) for folder in libraries)}

    def ready(self):
        if not self.bin("tarantella").exists() or not self.launcher_path.exists():
            return False
        banner = subprocess.run([str(self.launcher_path), "--version"], capture_output=True, text=True,
                                env=dict(os.environ, **self.env()))
        return self.banner in banner.stdout


MPIS = {
    "mpich": Mpi("MPICH", pathlib.Path(sys.executable).parent.parent, "bin/mpiexec", "HYDRA"),
    "openmpi": Mpi("Open MPI", REPO / ".venv-openmpi-tests", "bin/mpirun", "(Open MPI) 5.", "openmpi"),
    "impi": Mpi("Intel MPI", REPO / ".venv-impi-tests", "bin/mpiexec", "Intel(R) MPI", "impi-rt"),
    # Debian 12's Open MPI 4.1 and what it needs beyond a base system with Python.
    "openmpi4": Mpi("Open MPI", REPO / ".venv-openmpi4-tests", "debian/usr/bin/mpirun.openmpi", "(OpenRTE) 4.",
                    debian_packages=("openmpi-bin", "openmpi-common", "libopenmpi3", "libfabric1", "libucx0",
                                     "libpsm2-2", "libpsm-infinipath1", "libibverbs1", "ibverbs-providers",
                                     "librdmacm1", "libnl-3-200", "libnl-route-3-200", "libhwloc15",
                                     "libevent-core-2.1-7", "libevent-pthreads-2.1-7", "libpmix2")),
}


def mpi_env(**extra):
    """The test's environment (quiet), with nothing that would pick another MPI or configure this
    one, except what `extra` sets."""
    env = quiet_env(**extra)
    chosen_elsewhere = ("OMPI_", "PRTE_", "PMIX_", "I_MPI_", "HYDRA_", "TNT_MPIEXEC", "MPI4PY_LIBMPI")
    for name in list(env):
        if name.startswith(chosen_elsewhere) and name not in extra:
            del env[name]
    return env


def _make_venv(mpi):
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(mpi.venv)], check=True)
    steps = [[str(mpi.bin("pip")), "install", "-q", "-e", f"{REPO}[cpu]", *filter(None, [mpi.pip_extra])]]
    if mpi.debian_packages:
        packages = mpi.venv / "debian-packages"
        packages.mkdir()
        steps.append(["sh", "-c", f'cd "{packages}" && apt-get download "$@" && for package in *.deb; do '
                                  f'dpkg -x "$package" "{mpi.venv / "debian"}" || exit 1; done', "-",
                      *mpi.debian_packages])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            break
    if done.returncode != 0 or not mpi.ready():
        message = f"cannot make {mpi.venv} with {mpi.name}:\n{done.stderr[-3000:]}"
        if ALL_TESTS:
            pytest.fail(message)
        pytest.skip(message)
    sys.stderr.write(f"\ncreated {mpi.venv} in {time.monotonic() - started:.0f} s\n")


@pytest.fixture(scope="session")
def mpi_venvs():
    """Gives the MPI of a key of MPIS, making its venv first where it is missing or broken."""
    def venv_of(key):
        mpi = MPIS[key]
        if not mpi.ready():
            if not mpi.pip_extra and not mpi.debian_packages:
                pytest.skip(f"the suite's venv has no {mpi.name} (pip install -e '.[cpu,mpich,test]')")
            if mpi.debian_packages and not (shutil.which("apt-get") and shutil.which("dpkg")):
                pytest.skip(f"{mpi.name} comes from Debian's packages here, and apt-get or dpkg is missing")
            _make_venv(mpi)
        return mpi
    return venv_of


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    closed_folder: tuple  # (a folder this user cannot pass, the entry in it it must reach, an open stand-in) or ()

    def command(self, command):
        as_user = ["runuser", "-u", self.name, "--", *map(str, command)]
        if not self.closed_folder:
            return as_user
        # In a mount namespace of its own, an open folder holding just the entry on the way to the
        # interpreter (e.g. a pyenv Python under /root, which is closed) takes the closed one's place.
        script = 'mount --bind "$1/$2" "$3/$2" && mount --rbind "$3" "$1" && shift 3 && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "-", *self.closed_folder,
                *as_user]

    def folder(self):
        """A new folder this user may write."""
        folder = tempfile.mkdtemp(prefix=f"{self.name}-")
        os.chown(folder, self.uid, self.gid)
        return pathlib.Path(folder)


def _first_closed_folder(path, stand_in):
    """The first folder on the way to `path` that other users cannot pass and the entry in it on the
    way, with `stand_in` made ready to take the folder's place; () where every folder is open."""
    parts = pathlib.Path(path).parts
    for depth in range(1, len(parts) - 1):
        folder = pathlib.Path(*parts[:depth + 1])
        if not folder.stat().st_mode & 0o001:
            os.makedirs(os.path.join(stand_in, parts[depth + 1]))
            os.chmod(stand_in, 0o755)
            return (str(folder), parts[depth + 1], stand_in)
    return ()


@pytest.fixture(scope="session")
def unprivileged_user():
    """A user made for the session (removed afterwards, with its processes and files); where the
    suite does not run as root, its own user already is one: None."""
    if os.geteuid() != 0:
        yield None
        return
    if not all(map(shutil.which, ("useradd", "userdel", "runuser", "unshare"))):
        pytest.skip("needs useradd, userdel, runuser and unshare to run as a user other than root")
    name = f"tntmpi{os.getpid() % 100000}"
    home = tempfile.mkdtemp(prefix=f"{name}-home-")
    stand_in = tempfile.mkdtemp(prefix=f"{name}-open-")
    subprocess.run(["useradd", "--no-create-home", "--home-dir", home, "--shell", "/bin/sh", name], check=True,
                   capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        user = User(name, entry.pw_uid, entry.pw_gid, home,
                    _first_closed_folder(os.path.realpath(sys.executable), stand_in))
        probe = subprocess.run(user.command([sys.executable, "-c", f"open({str(REPO / 'README.md')!r})"]),
                               capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"user {name} cannot read the checkout or its venvs: {probe.stderr.strip()[-300:]}")
        yield user
    finally:
        _end_processes_of(pwd.getpwnam(name).pw_uid)
        subprocess.run(["userdel", name], capture_output=True)
        for folder in (home, stand_in, *pathlib.Path(tempfile.gettempdir()).glob(f"{name}-*")):
            shutil.rmtree(folder, ignore_errors=True)


def _end_processes_of(uid):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.fixture(scope="module")
def serial_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    assert_ok(subprocess.run([sys.executable, str(TRAIN), "--mode", "serial", "--out", str(out), "--cases", CASE],
                             capture_output=True, text=True, timeout=300, env=quiet_env()))
    return load_npz(out / f"{CASE}.rank0.npz")


def assert_restarted_once_like_the_uninterrupted_run(process, reference, resumed, backups):
    """The job of `long_job.py` whose rank 1 was killed at fit 1, epoch 1, step 3 (backups every 2
    steps) was restarted once, from epoch 2, step 2, and ended with the uninterrupted run's
    weights, bit for bit, leaving no backup behind."""
    assert_ok(process)
    restarts = [line for line in process.stderr.splitlines() if line.startswith("tarantella: restart ")]
    assert len(restarts) == 1 and " Resuming from fit #1 at epoch 2, step 2 " in restarts[0], process.stderr
    expected, result = load_npz(reference / "weights.npz"), load_npz(resumed / "weights.npz")
    for name in expected:
        np.testing.assert_array_equal(result[name], expected[name], err_msg=name)
    assert not backups.exists()
