"""Prints the cores this rank may run on, whether every thread of it runs on them, and
TensorFlow's intra-op threads. With BIND_RANK_0_FIRST set, rank 0 binds itself (every thread)
to one core before importing tarantella, as a launcher or scheduler binding it would."""

import os

rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
if os.environ.get("BIND_RANK_0_FIRST") and rank == "0":
    core = {min(os.sched_getaffinity(0))}
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), core)

import tarantella as tnt  # noqa: E402
import tensorflow as tf  # noqa: E402

cores = sorted(os.sched_getaffinity(0))
threads = {tuple(sorted(os.sched_getaffinity(int(thread)))) for thread in os.listdir("/proc/self/task")}
print(f"rank {tnt.get_rank()} cores {cores} all threads {threads == {tuple(cores)}} "
      f"tensorflow threads {tf.config.threading.get_intra_op_parallelism_threads()}", flush=True)
