"""Run by the multi-host test on "hosts" that are network namespaces.

Each rank tells its network namespace, the PYTHONPATH and GREETING it got, how many ranks share
its node, the link tarantella measured, the fusion threshold and the gradient reduction it chose,
then trains the given cases of train_cases.py (none for "-")."""

import os
import sys

import tarantella as tnt  # noqa: F401  (first, as users should)
import keras
from mpi4py import MPI

from tarantella import backends
from tarantella.runtime import world

from train_cases import run_case

node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()}: {os.readlink('/proc/self/ns/net')} "
                 f"PYTHONPATH={os.environ.get('PYTHONPATH')} GREETING={os.environ.get('GREETING')} "
                 f"node ranks {node.Get_size()} fusion threshold {backends.fusion_threshold_bytes()} "
                 f"link {world.slowest_link().latency_s!r} {world.slowest_link().bytes_per_s!r} "
                 f"chosen {backends.fusion_threshold()[1]!r} "
                 f"reduction {type(world.gradient_reducer().reduction).__name__} on {keras.backend.backend()}\n")
sys.stdout.flush()
for name in sys.argv[2].split(",") if sys.argv[2] != "-" else []:
    run_case(name, "tnt", sys.argv[1])
