"""Several hosts on one machine (tests/netns_hosts.py): each "host" is a network namespace with
its own address and host name, reached through a stand-in for ssh that runs Hydra's proxy there.

The job starts from a hostfile of the hosts' addresses, the ranks talk over TCP, and the
result must equal serial Keras. Needs root and `ip` (CI runs as root); skipped otherwise.
"""

import importlib.util
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import WORKERS, assert_ok, assert_ranks_like_serial, launcher_command, quiet_env, run_python
from netns_hosts import namespace_hosts, network_namespace_of
from tarantella.backends.fusion import automatic_threshold_bytes

HOSTS = 3
CASES = "mlp-adam,wide-mlp-adam"  # the wide MLP's gradients, 1 MB in one bucket, go node by node
LONE_RANK_CASE = "lenet5-momentum"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with namespace_hosts(HOSTS, tmp_path_factory.mktemp("hosts")) as made:
        yield {"hostfile": made.hostfile, "namespaces": made.namespaces, "made": made,
               "env": {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(made.ssh)}}


@pytest.mark.parametrize("backend", [
    "tensorflow",
    *[pytest.param(backend, marks=pytest.mark.skipif(os.environ.get("TNT_BACKEND_TESTS") != "1",
                                                     reason="runs with TNT_BACKEND_TESTS=1"))
      for backend in ("jax", "torch")]])
def test_two_ranks_on_each_of_two_namespace_hosts_train_like_serial_keras_summing_node_by_node(
        hosts, tmp_path, backend):
    """A hostfile and --n-per-node 2: 4 ranks over TCP between the hosts and shared memory within.
    Buckets of 1 MiB or more (the wide MLP's) are summed within each host first, then across the
    hosts by one rank each (TNT_HIERARCHICAL_ALLREDUCE's automatic choice); the rest stays flat."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    serial, distributed = tmp_path / "serial", tmp_path / "tnt"
    serial.mkdir()
    distributed.mkdir()
    hostfile = tmp_path / "two-hosts"
    hostfile.write_text("\n".join(hosts["hostfile"].read_text().split()[:2]) + "\n")
    assert_ok(run_python(WORKERS / "train_cases.py", "--mode", "serial", "--out", serial, "--cases", CASES,
                         env={"KERAS_BACKEND": backend}))
    started = time.monotonic()
    process = subprocess.run(
        launcher_command() + ["--hostfile", str(hostfile), "--n-per-node", "2", "--no-gpu",
                              "-x", "GREETING=from the launcher", "-x", f"KERAS_BACKEND={backend}", "--",
                              str(WORKERS / "multihost.py"), str(distributed), CASES],
        capture_output=True, text=True, timeout=300, env=quiet_env(**hosts["env"]))
    elapsed = time.monotonic() - started
    assert_ok(process)
    assert elapsed < 120, f"the job took {elapsed:.0f} s"
    namespaces, links = [], set()
    for rank in range(4):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        # MPI sees two ranks per node, the -x variables arrived, large buckets go node by node
        assert " GREETING=from the launcher node ranks 2 " in line and line.endswith(f" reduction ByNode on {backend}")
        namespaces.append(line.split()[2])
        links.add(_link_and_threshold(line))
    own = network_namespace_of()
    # Every rank measured the same link and chose the same threshold, the one for 4 ranks on 2 nodes.
    assert len(links) == 1, links
    (latency_s, bytes_per_s, threshold, chosen), = links
    assert threshold == automatic_threshold_bytes(4, 2, latency_s, bytes_per_s) >= 32 << 10
    assert chosen.startswith("automatic, for 4 ranks on a link measured at ")
    assert len(set(namespaces)) == 2 and own not in namespaces, "the ranks run in the two hosts' namespaces"
    for case in CASES.split(","):
        assert_ranks_like_serial(serial, distributed, [case], 4, backend)



def _link_and_threshold(line):
    """(latency s, rate B/s, fusion threshold, how it was chosen) from a line of workers/multihost.py."""
    found = re.search(r" fusion threshold (\d+) link (\S+) (\S+) chosen '([^']*)' ", line)
    return float(found[2]), float(found[3]), int(found[1]), found[4]


def test_the_automatic_fusion_threshold_follows_the_link_the_job_measured(hosts, tmp_path):
    """Two hosts, one rank each, first on their links as they are, then on links that `tc` limits to
    200 Mb/s: the job measures the rate it gets and fuses its gradients into smaller buckets there,
    where a bucket's latencies are a smaller share of its longer transfer."""
    hostfile = tmp_path / "two-hosts"
    hostfile.write_text("\n".join(hosts["hostfile"].read_text().split()[:2]) + "\n")

    def measured(cases="-"):
        # UCX_TLS=tcp: else UCX finds both ranks on one machine and takes shared memory past the links.
        process = subprocess.run(launcher_command() + ["--hostfile", str(hostfile), "--no-gpu", "-x", "UCX_TLS=tcp",
                                                       "--", str(WORKERS / "multihost.py"), str(distributed), cases],
                                 capture_output=True, text=True, timeout=120, env=quiet_env(**hosts["env"]))
        assert_ok(process)
        found = {_link_and_threshold(l) for l in process.stdout.splitlines() if l.startswith("rank ")}
        assert len(found) == 1, found  # every rank the same
        return found.pop()

    # A rank alone on its host computes with all the host's threads: LeNet-5 still trains like serial Keras.
    serial, distributed = tmp_path / "serial", tmp_path / "tnt"
    serial.mkdir()
    distributed.mkdir()
    assert_ok(run_python(WORKERS / "train_cases.py", "--mode", "serial", "--out", serial, "--cases", LONE_RANK_CASE))
    unshaped = measured(LONE_RANK_CASE)
    assert_ranks_like_serial(serial, distributed, [LONE_RANK_CASE], 2, "tensorflow")
    hosts["made"].shape(200e6)
    try:
        shaped = measured()
    finally:
        hosts["made"].shape(None)
    for latency_s, bytes_per_s, threshold, _ in (unshaped, shaped):
        assert 0 < latency_s < 0.05
        assert threshold == automatic_threshold_bytes(2, 2, latency_s, bytes_per_s)
    assert 0.5 * 25e6 < shaped[1] < 1.1 * 25e6, f"measured {shaped[1] / 1e6:.1f} MB/s on a 25 MB/s link"
    assert unshaped[1] > 4 * shaped[1]
    assert shaped[2] < unshaped[2], (shaped, unshaped)


def test_cleanup_runs_on_every_host_of_the_hostfile(hosts):
    process = subprocess.run(launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--cleanup", "--",
                                                   f"nothing_runs_this_{os.getpid()}.py"],
                             capture_output=True, text=True, timeout=60, env=quiet_env(**hosts["env"]))
    assert_ok(process)
    reports = [line for line in process.stdout.splitlines() if f"running nothing_runs_this_{os.getpid()}.py" in line]
    assert len(reports) == HOSTS and all("sent SIGTERM to 0 process(es)" in line for line in reports), reports


def _processes_in(namespaces):
    return [pid for namespace in namespaces for pid in subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()]


def test_a_host_whose_mpi_proxy_dies_is_named_and_the_job_ends(hosts):
    # On a cluster the proxy dies with its ssh connection or by the OOM killer. Its rank trained
    # on for ever, unseen by the command, while the others waited for it. Each "host" has a host
    # name of its own, so the command cannot watch its processes.
    launcher = subprocess.Popen(
        launcher_command() + ["--hostfile", str(hosts["hostfile"]), "--no-gpu", "--", str(WORKERS / "scenarios.py"),
                              "train-until-interrupted"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=quiet_env(**hosts["env"]))
    try:
        training = 0
        for line in launcher.stderr:
            training += line.endswith(": training\n")
            if training == HOSTS:
                break
        third_host = _processes_in(hosts["namespaces"][-1:])
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
        while _processes_in(hosts["namespaces"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = _processes_in(hosts["namespaces"])
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    stderr = "".join(rest)
    assert launcher.returncode not in (0, None), stderr
    assert seconds < 10
    third = re.escape(hosts["namespaces"][-1])
    named = (rf"rank [01] on host \S+ raised RankFailedError: rank 2 on host {third} lost its MPI proxy "
             rf"\(hydra_pmi_proxy, pid {proxy}\): it ended \(killed, or its ssh connection dropped\), so this rank "
             r"stopped\.")
    # MPICH's mpiexec mostly ends at once when a proxy's connection closes, taking every
    # rank's output with it: then no rank can report, and the line says what happened.
    ended_at_once = (r"the MPI launcher ended while rank 0 on host \S+, rank 1 on host \S+, rank 2 on host "
                     rf"{third} had not finished, and no rank reported a failure: it lost one of its own processes "
                     r"\(a proxy killed, or an ssh connection dropped\); see its messages above\.")
    assert re.fullmatch(rf"tarantella: the job failed \(exit status \d+\): (?:{named}|{ended_at_once})",
                        stderr.strip().splitlines()[-1]), stderr
    assert leftovers == []
