"""Where the ranks go: the hosts (a hostfile, or a Slurm allocation's nodes and tasks per node),
the ranks on each node, whether they use GPUs, and this node's NUMA nodes and cores. Found
without TensorFlow or MPI."""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from tarantella.common import config
from tarantella.launcher.messages import LaunchError


@dataclass
class Placement:
    hosts: list  # empty: this node only
    ranks_per_node: int
    use_gpu: bool
    warnings: list

    @property
    def ranks(self):
        return self.ranks_per_node * max(1, len(self.hosts))

    def hosts_with_slots(self):
        """'node01:2,node02:2'"""
        return ",".join(f"{host}:{self.ranks_per_node}" for host in self.hosts)


def hosts_of_the_job(options):
    """The hostfile's hosts, else the Slurm allocation's nodes, else [] (this node)."""
    if options.hostfile:
        return read_hostfile(options.hostfile)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    return expand_slurm_nodelist(nodelist) if nodelist else []


def read_hostfile(path):
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise LaunchError(f"cannot read the hostfile {path!r}: {error.strerror}.") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if len(name.split()) > 1 or ":" in name:
            raise LaunchError(f"{path}, line {number}: {line.strip()!r} is not a host name. Write one host "
                              "name per line and give the ranks per node with --n-per-node.")
        if name in hosts:
            raise LaunchError(f"{path}, line {number}: host {name!r} is listed twice. Name each host once "
                              "and give the ranks per node with --n-per-node.")
        hosts.append(name)
    if not hosts:
        raise LaunchError(f"the hostfile {path!r} names no host. Write one host name per line.")
    return hosts


def expand_slurm_nodelist(nodelist):
    """'node[01-03,07],gpu1' -> ['node01', 'node02', 'node03', 'node07', 'gpu1']."""
    names = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text + number for number in _expand_ranges(ranges, nodelist)] if ranges else [text]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        names += expanded
    return names


def _expand_ranges(ranges, nodelist):
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise LaunchError(f"cannot read the Slurm node list {nodelist!r}; give the hosts with --hostfile.")
        numbers += [str(n).zfill(len(first)) for n in range(int(first), int(last or first) + 1)]
    return numbers


def _slurm_ranks_per_node():
    """Slurm's tasks per node when every node has the same number, else None."""
    if os.environ.get("SLURM_NTASKS_PER_NODE"):
        return int(os.environ["SLURM_NTASKS_PER_NODE"])
    counts = set()
    for entry in os.environ.get("SLURM_TASKS_PER_NODE", "").split(","):  # e.g. "2(x3),2"
        match = re.fullmatch(r"(\d+)(?:\(x\d+\))?", entry)
        if match:
            counts.add(int(match.group(1)))
    if len(counts) > 1:
        # e.g. `sbatch -n 3 -N 2`: running one rank per node instead would leave tasks idle, silently.
        raise LaunchError(f"the Slurm allocation has different numbers of tasks per node (SLURM_TASKS_PER_NODE="
                          f"{os.environ['SLURM_TASKS_PER_NODE']}), and tarantella runs as many ranks on every "
                          "node. Ask Slurm for the same number on each (--ntasks-per-node), or give -n or "
                          "--n-per-node.")
    return counts.pop() if counts else None


def place_ranks(options, hosts, gpus):
    """How many ranks run on each node, and whether they use GPUs."""
    nodes = max(1, len(hosts))
    per_node = options.n_per_node
    if options.ranks is not None:
        if per_node is not None and per_node * nodes != options.ranks:
            raise LaunchError(f"-n {options.ranks} does not equal --n-per-node {per_node} x {nodes} node(s). "
                              "Give only one of them.")
        if options.ranks % nodes:
            raise LaunchError(f"-n {options.ranks} ranks cannot be spread evenly over {nodes} nodes. Give a "
                              "multiple of the node count, or --n-per-node.")
        per_node = options.ranks // nodes
    if per_node is None and hosts and not options.hostfile:
        per_node = _slurm_ranks_per_node()
    warnings = []
    shared = bool(gpus) and config.share_gpus()  # TNT_SHARE_GPUS: more ranks than GPUs share them
    if per_node is None:
        per_node = gpus or 1
        if not gpus and not options.no_gpu:
            warnings.append("no GPU found, so one rank per node runs on CPU. Choose the number of ranks with "
                            "-n or --n-per-node; --no-gpu silences this warning.")
    elif gpus < per_node and not options.no_gpu and not shared:
        fix = (f"Use --n-per-node {gpus} to train on the GPUs, or TNT_SHARE_GPUS=true to let the ranks share "
               "them; --no-gpu" if gpus else "--no-gpu")
        warnings.append(f"{per_node} ranks per node but {f'only {gpus}' if gpus else 'no'} GPU(s), so every "
                        f"rank runs on CPU. {fix} silences this warning.")
    if options.pin_to_socket or options.pin_memory_to_socket:
        _check_numa_nodes(per_node)
    on_gpus = bool(gpus) and (gpus >= per_node or shared) and not options.no_gpu
    return Placement(hosts, per_node, use_gpu=on_gpus, warnings=warnings)


def _check_numa_nodes(per_node):
    if not shutil.which("numactl"):
        raise LaunchError("--pin-to-socket and --pin-memory-to-socket need numactl, which is not on PATH. "
                          "Install it (e.g. apt-get install numactl) on every node, or leave out the flags.")
    hardware = subprocess.run(["numactl", "--hardware"], capture_output=True, text=True).stdout
    match = re.search(r"available: (\d+) nodes", hardware)
    numa_nodes = int(match.group(1)) if match else 1
    if numa_nodes < per_node:
        raise LaunchError(f"cannot pin {per_node} ranks per node to sockets: this node has {numa_nodes} NUMA "
                          f"node(s). Run at most {numa_nodes} rank(s) per node (--n-per-node), or leave out "
                          "the pinning flags.")
