#!/usr/bin/env bash
# Builds the virtual environment in which benchmarks/scaling.py and benchmarks/emulated_cluster.py
# run their `horovod` variants:
# Horovod 0.28.1 (which does not support Keras 3) on TensorFlow 2.15 with Keras 2, compiled
# against the same MPICH wheel, at the same version, as tarantella's environment, so that both
# run on one MPI under one mpiexec.
#
#   bash benchmarks/make_horovod_venv.sh [VENV]
#
# VENV defaults to .venv-horovod in the repository, the scripts' default --horovod-venv.
# TARANTELLA_PYTHON (default: the repository's .venv/bin/python, else python3) names the
# interpreter whose mpich wheel sets the version; PYTHON (default python3, 3.9 to 3.11, as
# TensorFlow 2.15 requires) makes the new environment. Needs a C++ compiler (apt-get install g++).
set -euo pipefail

repository="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repository/.venv-horovod}"
python="${PYTHON:-python3}"
if [[ -z "${TARANTELLA_PYTHON:-}" ]]; then
    TARANTELLA_PYTHON="$repository/.venv/bin/python"
    [[ -x "$TARANTELLA_PYTHON" ]] || TARANTELLA_PYTHON=python3
fi

if ! mpich_version="$("$TARANTELLA_PYTHON" -c 'import importlib.metadata as m; print(m.version("mpich"))' 2>/dev/null)"; then
    echo "make_horovod_venv: $TARANTELLA_PYTHON has no mpich wheel (pip install 'tarantella[mpich]');" \
         "set TARANTELLA_PYTHON to the interpreter that runs tarantella." >&2
    exit 1
fi
if ! "$python" -c 'import sys; sys.exit(not (3, 9) <= sys.version_info[:2] <= (3, 11))'; then
    echo "make_horovod_venv: TensorFlow 2.15 needs Python 3.9 to 3.11; name one with PYTHON=..." >&2
    exit 1
fi
if ! command -v c++ >/dev/null; then
    echo "make_horovod_venv: Horovod compiles C++: install a compiler (apt-get install g++)." >&2
    exit 1
fi

echo "make_horovod_venv: $venv with mpich==$mpich_version (as $TARANTELLA_PYTHON has)"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# Horovod's build imports TensorFlow, and its runtime needs the rest; cmake<4 still accepts the
# old minimum versions of Horovod's third-party CMake files. mpi4py: tarantella's launcher starts
# every rank through it.
"$venv/bin/pip" install -q "tensorflow-cpu==2.15.1" "mpich==$mpich_version" mpi4py "cmake>=3.13,<4" \
    cloudpickle psutil pyyaml packaging wheel setuptools
# The mpich wheel ships mpicc/mpicxx and mpi.h in the environment's bin/ and include/, and its
# wrappers find both relative to themselves: with bin/ first on PATH, CMake's FindMPI takes them.
PATH="$venv/bin:$PATH" MPI_HOME="$venv" \
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_TENSORFLOW=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
    "$venv/bin/pip" install --no-build-isolation --no-deps --no-cache-dir "horovod==0.28.1"
TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/horovodrun" --check-build  # what Horovod says it was built with
