"""A real, small Slurm cluster on this machine, for the tests: munged, slurmctld and one slurmd
per "node", with a configuration of its own in a temporary directory.

Each node is a network namespace with its own address on a bridge and its own host name (a UTS
namespace), so a job really spans two hosts as far as Slurm, Hydra and MPI can tell: Debian's
Slurm is built without --enable-multiple-slurmd, so several slurmd on one host are not possible
otherwise. The nodes share this machine's file system and CPUs. Needs root and `ip`; Slurm and
munge come from Debian's `slurm-wlm` and `munge` packages (installed with apt when missing).

    python tests/cluster/slurm_cluster.py   # brings a cluster up, prints how to use it, waits
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "salloc", "scancel", "scontrol", "sacct")


def missing_programs():
    return [name for name in PROGRAMS if not shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]


def pmix_library_present():
    """Whether Slurm's PMIx plug-in can load: Debian's loads libpmix.so, which only libpmix-dev has."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return any(line.split()[:1] == ["libpmix.so"] for line in listing.splitlines())


def install_with_apt(log, packages=PACKAGES):
    """Installs the packages; returns None, or why it could not."""
    names = " and ".join(packages)
    if os.geteuid() != 0:
        return f"needs root to install {names} with apt-get"
    if not shutil.which("apt-get"):
        return f"no apt-get to install {names}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(log, "a") as output:
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
        if subprocess.run(install, stdout=output, stderr=output, env=env, timeout=900).returncode != 0:
            # A fresh machine's package lists may be missing or stale.
            subprocess.run(["apt-get", "update", "-q"], stdout=output, stderr=output, env=env, timeout=600)
            if subprocess.run(install, stdout=output, stderr=output, env=env, timeout=900).returncode != 0:
                with open(log) as text:
                    return f"apt-get install {' '.join(packages)} failed:\n" + text.read()[-2000:]
    return None


def _free_port():
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class SlurmCluster:
    """Start with `start()`, stop with `stop()` (always: it removes namespaces and daemons)."""

    def __init__(self, nodes=2, cpus_per_node=2):
        tag = f"tnts{os.getpid() % 10000}"
        self.tag = tag
        # A subnet of its own: the multi-host test uses 10.200-249.x.
        self.subnet = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
        self.controller_address = f"{self.subnet}.254"
        self.node_names = [f"{tag}n{index}" for index in range(1, nodes + 1)]
        self.node_addresses = [f"{self.subnet}.{index}" for index in range(1, nodes + 1)]
        self.namespaces = [f"{tag}ns{index}" for index in range(1, nodes + 1)]
        self.bridge = f"{tag}br"
        self.cpus_per_node = cpus_per_node
        self.directory = None
        self.processes = {}  # name -> Popen
        self.config = None

    # -- bring-up --------------------------------------------------------------------------

    def start(self):
        self.directory = tempfile.mkdtemp(prefix="tnt-slurm-")
        os.chmod(self.directory, 0o700)  # munged refuses a key or socket others could reach
        self._network()
        self._munge()
        self._configure()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", self.config])
        for name, namespace in zip(self.node_names, self.namespaces):
            os.makedirs(self.path(f"spool-{name}"), exist_ok=True)
            os.makedirs(self.path(f"tmp-{name}"), exist_ok=True)
            # The node's own host name and /etc/hosts, as on a real node: Hydra and MPI name hosts by
            # them. Not `ip netns exec`: it mounts a fresh /sys, without the cgroup file systems slurmd
            # checks at its start.
            self._daemon(f"slurmd-{name}", [
                "nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", f'mount --bind "$0" /etc/hosts && mount --bind "$1" "$2" && hostname {name} && '
                f'exec slurmd -D -N {name} -f "$3"', self.hosts_file, self.path(f"tmp-{name}"), self.node_tmp,
                self.config])
        self._wait_for_idle_nodes()
        return self

    def _network(self):
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        # The nodes' /etc/hosts: they know each other and this machine (the controller).
        hosts = ["127.0.0.1 localhost", f"{self.controller_address} {socket.gethostname()}"]
        hosts += [f"{address} {name}" for address, name in zip(self.node_addresses, self.node_names)]
        self.hosts_file = self.path("hosts")
        with open(self.hosts_file, "w") as file:
            file.write("\n".join(hosts) + "\n")
        for index, (namespace, address) in enumerate(zip(self.namespaces, self.node_addresses), 1):
            self._ip("netns", "add", namespace)
            self._ip("link", "add", f"{self.tag}v{index}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._ip("link", "set", f"{self.tag}v{index}", "master", self.bridge, "up")
            self._ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            self._ip("-n", namespace, "link", "set", "eth0", "up")
            self._ip("-n", namespace, "link", "set", "lo", "up")

    def _munge(self):
        key = self.path("munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
            file.write(os.urandom(1024))
        self.munge_socket = self.path("munge.socket")
        # --force: munged refuses to run as root, which the tests are (and Slurm's daemons too).
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                                f"--pid-file={self.path('munged.pid')}", f"--log-file={self.path('munged.log')}",
                                f"--seed-file={self.path('munged.seed')}"])
        self._wait(lambda: os.path.exists(self.munge_socket), "munged to open its socket", "munged.log")

    def _configure(self):
        self.config = self.path("slurm.conf")
        # A directory at the same path on every node but private to each, as /tmp is on real nodes:
        # Slurm's PMIx plug-in makes a directory per step there, named alike on every node.
        self.node_tmp = self.path("node-tmp")
        os.makedirs(self.node_tmp, exist_ok=True)
        with open(self.path("mpi.conf"), "w") as file:
            file.write(f"PMIxCliTmpDirBase={self.node_tmp}\n")
        nodes = "\n".join(f"NodeName={name} NodeAddr={address} CPUs={self.cpus_per_node} State=UNKNOWN"
                          for name, address in zip(self.node_names, self.node_addresses))
        with open(self.config, "w") as file:
            file.write(textwrap.dedent(f"""\
                ClusterName={self.tag}
                SlurmctldHost={socket.gethostname()}({self.controller_address})
                SlurmctldPort={_free_port()}
                SlurmdPort={_free_port()}
                SlurmUser=root
                SlurmdUser=root
                AuthType=auth/munge
                CredType=cred/munge
                AuthInfo=socket={self.munge_socket}
                StateSaveLocation={self.path('state')}
                SlurmdSpoolDir={self.path('spool-%n')}
                SlurmctldPidFile={self.path('slurmctld.pid')}
                SlurmdPidFile={self.path('slurmd-%n.pid')}
                SlurmctldLogFile={self.path('slurmctld.log')}
                SlurmdLogFile={self.path('slurmd-%n.log')}
                # No cgroups in a container: Slurm finds a job's processes through /proc instead.
                ProctrackType=proctrack/linuxproc
                TaskPlugin=task/none
                JobAcctGatherType=jobacct_gather/none
                # Finished jobs go to a text file that `sacct --completion` reads: no database needed.
                JobCompType=jobcomp/filetxt
                JobCompLoc={self.path('jobcomp.txt')}
                AccountingStorageType=accounting_storage/none
                SelectType=select/cons_tres
                SelectTypeParameters=CR_CPU
                MpiDefault=none
                ReturnToService=2
                SlurmdParameters=config_overrides
                KillWait=5
                InactiveLimit=0
                TmpFS={self.node_tmp}
                {nodes}
                PartitionName=tnt Nodes=ALL Default=YES MaxTime=INFINITE State=UP
                """))
        os.makedirs(self.path("state"), exist_ok=True)

    def _daemon(self, name, command):
        log = open(self.path(f"{name}.out"), "w")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env(), start_new_session=True)
        log.close()

    def _wait_for_idle_nodes(self, timeout=60):
        def idle():
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                                    env=self.env()).stdout.split()
            return states.count("idle") == len(self.node_names)
        self._wait(idle, "every node to be idle", "slurmctld.log", timeout)

    def _wait(self, condition, what, log, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n"
                                       + self.logs())
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}:\n" + self.logs())

    # -- use ---------------------------------------------------------------------------------

    def path(self, name):
        return os.path.join(self.directory, name)

    def env(self, base=None, **extra):
        env = dict(os.environ if base is None else base)
        for name in list(env):  # a job of the test's own must not think it runs inside another
            if name.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_")):
                del env[name]
        env["SLURM_CONF"] = self.config or ""
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env.update(extra)
        return env

    def logs(self, characters=3000):
        text = []
        for name in sorted(os.listdir(self.directory)) if self.directory else []:
            if name.endswith((".log", ".out")):
                with open(self.path(name), errors="replace") as file:
                    text.append(f"--- {name}\n{file.read()[-characters:]}")
        return "\n".join(text)

    def processes_in_nodes(self):
        """Process ids that run in the nodes' network namespaces (slurmd and what it started)."""
        pids = []
        for namespace in self.namespaces:
            listing = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
            pids += [int(pid) for pid in listing.split()]
        return pids

    def daemon_pids(self):
        return {process.pid for name, process in self.processes.items() if name.startswith("slurmd-")}

    # -- tear-down -----------------------------------------------------------------------------

    def stop(self):
        for name, process in reversed(list(self.processes.items())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in self.processes_in_nodes():  # job steps slurmd left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for index, namespace in enumerate(self.namespaces, 1):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.tag}v{index}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def _ip(*arguments):
        subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=30)


if __name__ == "__main__":
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # so that the clean-up below runs
    cluster = SlurmCluster()
    try:
        started = time.monotonic()
        cluster.start()
        print(f"up in {time.monotonic() - started:.1f} s: export SLURM_CONF={cluster.config}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
