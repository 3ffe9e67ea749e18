"""A stand-in for MPI in a serial run where mpi4py or an MPI library is missing: a communicator of
one process, whose every collective returns this process's own contribution."""

import os

import numpy as np


class SerialComm:
    """A communicator of one process, for a serial run without MPI: every collective's result
    is this process's own contribution."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Dup(self):
        return self

    def Split_type(self, *args, **kwargs):
        return self

    def Free(self):
        pass

    def Allreduce(self, send, recv=None, op=None):
        if send is not SerialMPI.IN_PLACE:
            np.copyto(recv, send)

    def Bcast(self, buffer, root=0):
        pass

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def Allgatherv(self, send, recv):
        buffer, _counts = recv
        np.copyto(buffer, send)

    def Abort(self, status=1):
        os._exit(status)


class SerialMPI:
    """Stands in for mpi4py's MPI module (the names tarantella uses) in a serial run without MPI."""
    IN_PLACE = object()
    SUM, PROD, MIN, MAX = "sum", "prod", "min", "max"
    COMM_TYPE_SHARED = None
    COMM_WORLD = SerialComm()
