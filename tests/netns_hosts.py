"""Several "hosts" on one machine, for multi-host tests: each host is a network namespace with
its own address on a bridge, reached through a stand-in for ssh that runs the remote command
inside the namespace with `ip netns exec`.

Like sshd, the stand-in starts the remote command with a fresh environment (PATH, HOME, USER
and LANG only), so whatever a rank needs must come through the MPI launcher. Needs root and
`ip`; `namespace_hosts` skips the calling test otherwise.
"""

import contextlib
import dataclasses
import itertools
import os
import shutil
import socket
import subprocess
import textwrap

import pytest

_serial_numbers = itertools.count()  # hosts made by one test session at the same time differ


@dataclasses.dataclass
class NamespaceHosts:
    addresses: list  # one per host, as the hostfile names them
    namespaces: list  # the network namespace of each host, in the same order
    hostfile: object  # pathlib.Path: the addresses, one per line
    ssh: object  # pathlib.Path: the ssh stand-in, for the MPI launcher's remote start
    links: list  # each host's veth on the bridge's side, in the same order

    def shape(self, rate_bit):
        """Every host's link limited to `rate_bit` bit/s in each direction by `tc`'s token bucket
        (the hosts' side and the bridge's); None removes the limit."""
        for namespace, outer in zip(self.namespaces, self.links):
            for device in (["ip", "netns", "exec", namespace, "tc"], ["tc"]):
                name = "eth0" if len(device) > 1 else outer
                subprocess.run(device + ["qdisc", "del", "dev", name, "root"], capture_output=True)
                if rate_bit is not None:
                    burst = max(3028, int(rate_bit / 8 * 200e-6))  # 200 us of traffic: the rate holds for 64 KiB
                    subprocess.run(device + ["qdisc", "add", "dev", name, "root", "tbf", "rate", f"{int(rate_bit)}bit",
                                             "burst", str(burst), "latency", "50ms"], check=True, capture_output=True)


def _ip(*arguments):
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def namespace_hosts(count, directory):
    """Creates `count` hosts with a hostfile and an ssh stand-in in `directory`; removes the
    namespaces, the bridge and every process left in them afterwards, whatever happens."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and the `ip` command (iproute2) to make network namespaces")
    serial = next(_serial_numbers)
    prefix = f"tnt{os.getpid() % 10000}s{serial}"
    namespaces = [f"{prefix}h{index}" for index in range(1, count + 1)]
    try:
        _ip("netns", "add", namespaces[0])
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"cannot create a network namespace here: {getattr(error, 'stderr', error)}")
    bridge = f"{prefix}br"
    subnet = f"10.{200 + os.getpid() % 50}.{(os.getpid() + serial) % 250}"
    addresses = [f"{subnet}.{index}" for index in range(1, count + 1)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index, (namespace, address) in enumerate(zip(namespaces, addresses), 1):
            if index > 1:
                _ip("netns", "add", namespace)
            _ip("link", "add", f"{prefix}v{index}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", f"{prefix}v{index}", "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # `ip netns exec` puts this file over /etc/hosts: a remote daemon finds the MPI
            # launcher, which names itself by this machine's host name, at the bridge's address.
            os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
            with open(f"/etc/netns/{namespace}/hosts", "w") as file:
                file.write(f"127.0.0.1 localhost\n{subnet}.254 {socket.gethostname()}\n"
                           + "".join(f"{peer} {name}\n" for peer, name in zip(addresses, namespaces)))
        hostfile = directory / "hostfile"
        hostfile.write_text("\n".join(addresses) + "\n")
        ssh = directory / "ssh-into-namespace"
        ssh.write_text(_ssh_stand_in(dict(zip(addresses, namespaces))))
        ssh.chmod(0o755)
        yield NamespaceHosts(addresses, namespaces, hostfile, ssh,
                             [f"{prefix}v{index}" for index in range(1, count + 1)])
    finally:
        for namespace in namespaces:
            _kill_processes_in(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _ssh_stand_in(namespace_of):
    cases = "\n".join(f"    {address}) namespace={namespace} ;;" for address, namespace in namespace_of.items())
    return textwrap.dedent("""\
        #!/bin/sh
        # Called as ssh is: ssh [options] HOST command... (Hydra passes -x, Open MPI's prte none).
        while [ "${1#-}" != "$1" ]; do shift; done
        host=$1; shift
        case $host in
        {cases}
            *) echo "ssh-into-namespace: unknown host $host" >&2; exit 255 ;;
        esac
        # Each host has its own host name too (a UTS namespace): MPI tells nodes apart by it.
        exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" USER="$(id -un)" LANG=C.UTF-8 \\
            ip netns exec "$namespace" unshare --uts sh -c 'hostname "$1"; shift; exec sh -c "$*"' - "$namespace" "$*"
        """).replace("{cases}", cases)


def _kill_processes_in(namespace):
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


def network_namespace_of(pid="self"):
    return os.readlink(f"/proc/{pid}/ns/net")
