"""Several hosts on one machine: each "host" is a network namespace with its own address on a
bridge, reached through a stand-in for ssh that runs Hydra's proxy with `ip netns exec`.

The job starts from a hostfile of the hosts' addresses, the ranks talk over TCP, and the
result must equal serial Keras. Needs root and `ip` (CI runs as root); skipped otherwise.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launcher_command, quiet_env, run_python

HOSTS = 3
CASES = "mlp-adam,wide-mlp-adam"  # the wide MLP's 1 MiB gradients take the ring allreduce
TAG = f"tnt{os.getpid() % 10000}"
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"


def _ip(*arguments):
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=30)


def _namespace(index):
    return f"{TAG}h{index}"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Creates the namespaces, bridge and ssh stand-in; removes them again, whatever happens."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and the `ip` command (iproute2) to make network namespaces")
    try:
        _ip("netns", "add", _namespace(1))
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"cannot create a network namespace here: {getattr(error, 'stderr', error)}")
    bridge = f"{TAG}br"
    addresses = [f"{SUBNET}.{index}" for index in range(1, HOSTS + 1)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index, address in enumerate(addresses, 1):
            namespace = _namespace(index)
            if index > 1:
                _ip("netns", "add", namespace)
            _ip("link", "add", f"{TAG}v{index}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", f"{TAG}v{index}", "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # `ip netns exec` puts this file over /etc/hosts: the proxies find mpiexec, which
            # names itself by this machine's host name, at the bridge's address.
            os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
            with open(f"/etc/netns/{namespace}/hosts", "w") as file:
                file.write(f"127.0.0.1 localhost\n{SUBNET}.254 {socket.gethostname()}\n")
        directory = tmp_path_factory.mktemp("hosts")
        hostfile = directory / "hostfile"
        hostfile.write_text("\n".join(addresses) + "\n")
        fake_ssh = directory / "ssh-into-namespace"
        cases = "\n".join(f"    {address}) namespace={_namespace(i)} ;;" for i, address in enumerate(addresses, 1))
        fake_ssh.write_text(textwrap.dedent("""\
            #!/bin/sh
            # Hydra calls its ssh launcher as: ssh -x HOST "proxy command"
            [ "$1" = "-x" ] && shift
            host=$1; shift
            case $host in
            {cases}
                *) echo "ssh-into-namespace: unknown host $host" >&2; exit 255 ;;
            esac
            exec ip netns exec "$namespace" sh -c "$*"
            """).replace("{cases}", cases.strip()))
        fake_ssh.chmod(0o755)
        yield {"hostfile": hostfile, "env": {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(fake_ssh)}}
    finally:
        for index in range(1, HOSTS + 1):
            namespace = _namespace(index)
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def load(path):
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def test_a_job_over_three_namespace_hosts_trains_like_serial_keras(hosts, tmp_path):
    serial, distributed = tmp_path / "serial", tmp_path / "tnt"
    serial.mkdir()
    distributed.mkdir()
    assert_ok(run_python(WORKERS / "train_cases.py", "--mode", "serial", "--out", serial, "--cases", CASES))
    started = time.monotonic()
    process = subprocess.run(
        launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--no-gpu", "-x", "GREETING=from the launcher", "--",
                              str(WORKERS / "multihost.py"), str(distributed), CASES],
        capture_output=True, text=True, timeout=300, env=quiet_env(**hosts["env"]))
    elapsed = time.monotonic() - started
    assert_ok(process)
    assert elapsed < 120, f"the job took {elapsed:.0f} s"
    namespaces = set()
    for rank in range(HOSTS):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        # MPI sees one rank per node (no shared memory), and the -x variable arrived
        assert line.endswith(" GREETING=from the launcher node ranks 1"), line
        namespaces.add(line.split()[2])
    own = os.readlink("/proc/self/ns/net")
    assert len(namespaces) == HOSTS and own not in namespaces, "each rank runs in its own host's namespace"
    for case in CASES.split(","):
        expected = load(serial / f"{case}.rank0.npz")
        for rank in range(HOSTS):
            result = load(distributed / f"{case}.rank{rank}.npz")
            assert sorted(result) == sorted(expected)
            for key in expected:
                tolerance = {"atol": 1e-5} if key.startswith("weight_") else {"rtol": 1e-5, "atol": 1e-6}
                np.testing.assert_allclose(result[key], expected[key], **tolerance,
                                           err_msg=f"{case}, rank {rank}, {key}")


def test_cleanup_runs_on_every_host_of_the_hostfile(hosts):
    process = subprocess.run(launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--cleanup", "--",
                                                   f"nothing_runs_this_{TAG}.py"],
                             capture_output=True, text=True, timeout=60, env=quiet_env(**hosts["env"]))
    assert_ok(process)
    reports = [line for line in process.stdout.splitlines() if f"running nothing_runs_this_{TAG}.py" in line]
    assert len(reports) == HOSTS and all("sent SIGTERM to 0 process(es)" in line for line in reports), reports


def _processes_in_namespaces():
    return [pid for index in range(1, HOSTS + 1) for pid in subprocess.run(
        ["ip", "netns", "pids", _namespace(index)], capture_output=True, text=True).stdout.split()]


def test_a_host_whose_mpi_proxy_dies_is_named_and_the_job_ends(hosts, tmp_path):
    # On a cluster the proxy dies with its ssh connection or by the OOM killer. Its rank trained
    # on for ever, unseen by the command, while the others waited for it. Each "host" gets a
    # host name of its own here, so that the command cannot watch its processes.
    own_names = tmp_path / "ssh-with-own-host-name"
    own_names.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = "-x" ] && shift
        host=$1; shift
        exec unshare --uts -- sh -c 'hostname "h-$0"; exec "$1" -x "$0" "$2"' "$host" \
            {hosts["env"]["HYDRA_LAUNCHER_EXEC"]} "$*"
        """))
    own_names.chmod(0o755)
    launcher = subprocess.Popen(
        launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--no-gpu", "--", str(WORKERS / "scenarios.py"),
                              "train-until-interrupted"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=quiet_env(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(own_names)))
    try:
        training = 0
        for line in launcher.stderr:
            training += line.endswith(": training\n")
            if training == HOSTS:
                break
        third_host = subprocess.run(["ip", "netns", "pids", _namespace(HOSTS)], capture_output=True,
                                    text=True).stdout.split()
        proxy = next(int(pid) for pid in third_host if os.path.basename(
            open(f"/proc/{pid}/cmdline").read().split("\0")[0]) == "hydra_pmi_proxy")
        rest = []
        reader = threading.Thread(target=lambda: rest.append(launcher.stderr.read()), daemon=True)
        reader.start()
        os.kill(proxy, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=30)
        seconds = time.monotonic() - killed
        reader.join(timeout=10)
        deadline = time.monotonic() + 5
        while _processes_in_namespaces() and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = _processes_in_namespaces()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    stderr = "".join(rest)
    assert launcher.returncode not in (0, None), stderr
    assert seconds < 10
    third = re.escape(f"h-{SUBNET}.{HOSTS}")
    named = (rf"rank [01] on host h-\S+ raised RankFailedError: rank 2 on host {third} lost its MPI proxy "
             rf"\(hydra_pmi_proxy, pid {proxy}\): it ended \(killed, or its ssh connection dropped\), so this rank "
             r"stopped\.")
    # MPICH's mpiexec mostly ends at once when a proxy's connection closes, taking every
    # rank's output with it: then no rank can report, and the line says what happened.
    ended_at_once = (r"the MPI launcher ended while rank 0 on host h-\S+, rank 1 on host h-\S+, rank 2 on host "
                     rf"{third} had not finished, and no rank reported a failure: it lost one of its own processes "
                     r"\(a proxy killed, or an ssh connection dropped\); see its messages above\.")
    assert re.fullmatch(rf"tarantella: the job failed \(exit status \d+\): (?:{named}|{ended_at_once})",
                        stderr.strip().splitlines()[-1]), stderr
    assert leftovers == []
