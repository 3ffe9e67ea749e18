"""This node's hardware, found without a machine-learning framework or MPI: GPUs and cores."""

import os
import shutil
import subprocess


def count_gpus():
    """GPUs of this node, found without TensorFlow; the nodes of a job are taken to be alike."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for device in visible.split(","):  # CUDA ignores everything from the first invalid entry on
            if not device.strip() or device.strip().startswith("-"):
                break
            count += 1
        return count
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            return sum(line.startswith("GPU ") for line in listing.splitlines())
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def cores_here():
    """Physical cores this process may run on (hyperthreads share one)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as file:
                cores.add(file.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def cores_by_physical_core(cores):
    """`cores` ordered so that the hardware threads of one physical core are adjacent."""
    def place(cpu):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as package, open(topology + "core_id") as core:
                return int(package.read()), int(core.read()), cpu
        except (OSError, ValueError):
            return 0, cpu, cpu
    return sorted(cores, key=place)

