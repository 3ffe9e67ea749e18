"""MVAPICH, with its Hydra mpiexec: MPICH's flavour under its own name."""

from tarantella.launcher.mpis.mpich import Mpich


class Mvapich(Mpich):
    name = "MVAPICH"

    @staticmethod
    def recognises(banner):
        return "MVAPICH" in banner and Mpich.recognises(banner)
