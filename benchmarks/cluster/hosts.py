"""Emulated hosts for benchmarks/emulated_cluster.py: network namespaces on one bridge, each
host's link shaped with `tc ... tbf` in both directions, and an ssh stand-in through which
Hydra (the mpich wheel's mpiexec) starts its proxy inside a host's namespace.

Shaping: a real host's NIC limits what it sends and what it receives. A namespace's eth0 gets
a tbf qdisc on its egress (what the host sends); the bridge side of its veth pair gets one on
its egress (what the host receives). tbf only limits the rate; this kernel has no netem, so no
delay is added: a link's latency is the veth pair's and the bridge's own, measured by
`measure_links` and stated with every result.

Needs root and `ip`/`tc` (iproute2). Everything made here is removed again on exit, also on
failure or Ctrl+C (`EmulatedHosts` is a context manager; `cleanup_stale` removes what a killed
run left behind, by the name prefix this module gives everything).
"""

import contextlib
import os
import shutil
import socket
import subprocess
import textwrap

PREFIX = "tntec"  # every namespace, bridge and veth made here starts with it


class LinkProfile:
    """A link as the emulation shapes it: `gbit` its nominal rate per direction, `latency_us` its
    nominal one-way latency (for the projection; the emulation cannot add delay), `burst_bytes` the
    token bucket's depth at the nominal rate."""

    def __init__(self, name, gbit, latency_us, description):
        self.name, self.gbit, self.latency_us, self.description = name, gbit, latency_us, description

    def shaped_rate_bit(self, scale):
        """The tbf rate in bit/s: the nominal rate divided by the byte scale (see emulated_cluster)."""
        return self.gbit * 1e9 / scale


# Nominal figures: EDR InfiniBand (100 Gb/s, about 1-2 us MPI latency) and 10 GbE over TCP (about
# 20-30 us through a kernel stack and a switch).
PROFILES = {
    "ib": LinkProfile("ib", 100.0, 1.5, "InfiniBand-like: 100 Gb/s, 1.5 us"),
    "10gbe": LinkProfile("10gbe", 10.0, 25.0, "10 GbE-like: 10 Gb/s, 25 us"),
}


def run(*command, check=True):
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=60)


def available():
    """None where namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"needs the `{tool}` command (iproute2)"
    return None


def cleanup_stale():
    """Removes namespaces and links that an earlier run of this module left (it was killed)."""
    listed = run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(PREFIX):
            _kill_processes_in(name)
            run("ip", "netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    for line in run("ip", "-o", "link", "show", check=False).stdout.split("\n"):
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(PREFIX):
            run("ip", "link", "del", parts[1].split("@")[0], check=False)


def _kill_processes_in(namespace):
    for pid in run("ip", "netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


class EmulatedHosts(contextlib.AbstractContextManager):
    """`count` hosts h1..hN: namespaces with addresses 10.<a>.<b>.1..N on one bridge, a hostfile,
    an ssh stand-in, and each host's link shaped by `shape()`."""

    _made = 0

    def __init__(self, count, directory, tag=None):
        problem = available()
        if problem:
            raise RuntimeError(problem)
        # A tag of its own per instance: a namespace's deletion ends its veth pair asynchronously,
        # so the next instance of the same run must not reuse the names.
        EmulatedHosts._made += 1
        tag = tag if tag is not None else f"{os.getpid() % 100000}{chr(ord('a') + EmulatedHosts._made % 26)}"
        self.prefix = f"{PREFIX}{tag}"
        self.namespaces = [f"{self.prefix}h{index}" for index in range(1, count + 1)]
        self.bridge = f"{self.prefix}br"
        subnet = f"10.{210 + os.getpid() % 40}.{os.getpid() // 40 % 250}"
        self.addresses = [f"{subnet}.{index}" for index in range(1, count + 1)]
        self.bridge_address = f"{subnet}.254"
        self.outer = [f"{self.prefix}v{index}" for index in range(1, count + 1)]  # bridge side of each veth
        self.directory = directory
        self.hostfile = os.path.join(directory, "hostfile")
        self.ssh = os.path.join(directory, "ssh-into-namespace")
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self):
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for namespace, address, outer in zip(self.namespaces, self.addresses, self.outer):
            run("ip", "netns", "add", namespace)
            run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            run("ip", "link", "set", outer, "master", self.bridge, "up")
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", namespace, "link", "set", "eth0", "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            # `ip netns exec` mounts this over /etc/hosts: the hosts find each other and the launcher.
            os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
            with open(f"/etc/netns/{namespace}/hosts", "w") as hosts:
                hosts.write(f"127.0.0.1 localhost\n{self.bridge_address} {socket.gethostname()}\n"
                            + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.namespaces)))
        with open(self.hostfile, "w") as hostfile:
            hostfile.write("\n".join(self.addresses) + "\n")
        with open(self.ssh, "w") as ssh:
            ssh.write(self._ssh_stand_in())
        os.chmod(self.ssh, 0o755)

    def _ssh_stand_in(self):
        cases = "\n".join(f"    {a}|{n}) namespace={n} ;;" for a, n in zip(self.addresses, self.namespaces))
        # Like sshd: a fresh environment; each host its own host name (a UTS namespace), so that MPI
        # sees one node per host and uses TCP between them.
        return textwrap.dedent("""\
            #!/bin/sh
            while [ "${1#-}" != "$1" ]; do shift; done
            host=$1; shift
            case $host in
            {cases}
                *) echo "ssh-into-namespace: unknown host $host" >&2; exit 255 ;;
            esac
            exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" USER="$(id -un)" LANG=C.UTF-8 \\
                ip netns exec "$namespace" unshare --uts sh -c 'hostname "$1"; shift; exec sh -c "$*"' - "$namespace" "$*"
            """).replace("{cases}", cases)

    def exec_in(self, index, command):
        """`command` (a list) run inside host `index`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[index]] + list(command)

    def shape(self, rate_bit):
        """Every host's link limited to `rate_bit` bit/s in both directions (None: unshaped)."""
        for namespace, outer in zip(self.namespaces, self.outer):
            for device in (["ip", "netns", "exec", namespace, "tc"], ["tc"]):
                name = "eth0" if len(device) > 1 else outer
                run(*device, "qdisc", "del", "dev", name, "root", check=False)
                if rate_bit is not None:
                    # A small bucket (200 us of traffic, at least two full frames): a larger one
                    # would let a whole ring step of a scaled bucket pass at once, unshaped.
                    burst = max(3028, int(rate_bit / 8 * 200e-6))
                    run(*device, "qdisc", "add", "dev", name, "root", "tbf", "rate", f"{int(rate_bit)}bit",
                        "burst", str(burst), "latency", "50ms")

    def bytes_sent(self):
        """The bytes every host has sent over its link so far (what the bridge side of its veth
        received): traffic between hosts only, since ranks on one host talk over shared memory."""
        total = 0
        for outer in self.outer:
            with open(f"/sys/class/net/{outer}/statistics/rx_bytes") as counter:
                total += int(counter.read())
        return total

    def mpi_environment(self):
        """What the MPI launcher needs to start its proxies in the hosts."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": self.ssh}

    def close(self):
        for outer in self.outer:
            run("ip", "link", "del", outer, check=False)
        for namespace in self.namespaces:
            _kill_processes_in(namespace)
            run("ip", "netns", "del", namespace, check=False)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
        run("ip", "link", "del", self.bridge, check=False)

    def __exit__(self, *exc):
        self.close()
        return False
