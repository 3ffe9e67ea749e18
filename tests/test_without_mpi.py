"""A serial `python train.py` runs without MPI (size 1); a rank of a launched job without MPI fails clearly."""

import json
import re

from conftest import WORKERS, assert_ok, launch, run_python

WORKER = WORKERS / "without_mpi.py"


def test_a_serial_program_trains_as_keras_where_mpi4py_cannot_be_imported(tmp_path):
    hidden = tmp_path / "hidden" / "mpi4py"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("No module named mpi4py (hidden by the test)")\n')
    process = run_python(WORKER, tmp_path / "result.json",
                         env={"PYTHONPATH": str(hidden.parent), "TNT_LOG_LEVEL": "INFO"}, timeout=300)
    assert_ok(process)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["size"], result["rank"], result["mpi_loaded"]) == (1, 0, False)
    assert result["allreduce"] == [1.0, 2.0]  # a collective of one process returns its input
    assert result["weights_difference"] <= 1e-6
    assert result["loss"] == result["serial_loss"]
    # Nothing alarming: tarantella's one line is at INFO level (hidden at the default level).
    said = [line for line in process.stderr.splitlines() if "tarantella" in line.lower()]
    assert said == ["[tarantella] INFO: no MPI (No module named mpi4py (hidden by the test)): running as a "
                    "single process, without MPI."], process.stderr


def test_ranks_of_a_launched_job_without_an_mpi_library_fail_with_the_clear_error(tmp_path):
    process = launch(2, WORKER, tmp_path / "result.json", env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"},
                     timeout=300)
    assert process.returncode != 0
    clear = ("ImportError: tarantella found no MPI (cannot load MPI library), but this process was started as a "
             "rank of a parallel job. Install MPI for it: pip install 'tarantella[mpich]'")
    # Each rank that gets as far as importing tarantella says so; MPICH's launcher ends the other rank as
    # soon as one exits with an error, so on a loaded machine the slower one may be killed while it still
    # imports TensorFlow, before it prints (seen once in a CI-like run, 2026-11-26).
    errors = [line for line in process.stderr.splitlines() if re.match(r"\w+Error: ", line)]
    assert 1 <= len(errors) <= 2 and all(line.startswith(clear) for line in errors), process.stderr
    assert process.stderr.strip().splitlines()[-1].startswith("tarantella: the job failed (exit status 1): rank ")
    assert not (tmp_path / "result.json").exists()
