"""Inputs whose spec leaves a dimension open train on 1, 2 and 3 ranks as serial Keras trains on them,
on every Keras backend: windows of `keras.utils.timeseries_dataset_from_array` (specced
(None, None, features)) into a model built for their length, an unbuilt model that predict builds
from them, sequences `padded_batch`-ed to each batch's longest, a dict of such inputs, and a
PyDataset whose batches have lengths of their own (tests/workers/input_shapes.py, against the same
worker run serially on the same backend, at tests/conftest.py's tolerances).

Built from the dataset's spec, Keras-on-torch filled the open dimension with 83 and refused the
windows, and Keras-on-JAX could not build a Flatten before a Dense; Keras' own trainers build from
the first batch they read, and so does tnt.Model now.

The default run takes JAX on 2 ranks, the windows into a model built for their length;
TNT_BACKEND_TESTS=1 runs every case on every installed backend on 1, 2 and 3 ranks. keras-io's
weather forecasting example, an LSTM on such windows, is a first-contact script
(tests/first_contact/weather_forecasting.py).
"""

import importlib.util
import os

import pytest

from conftest import WORKERS, assert_ok, assert_ranks_like_serial, launch, run_python
from workers.input_shapes import CASES

WORKER = WORKERS / "input_shapes.py"
ALL = os.environ.get("TNT_BACKEND_TESTS") == "1"
BACKENDS = ("tensorflow", "jax", "torch")
DEFAULT = {("jax", 2): ["timeseries-flatten"]}


def chosen():
    """(backend, ranks, cases) of this run; a backend that is not installed is skipped."""
    for backend in BACKENDS:
        for ranks in (1, 2, 3):
            cases = CASES if ALL else DEFAULT.get((backend, ranks))
            if cases:
                missing = importlib.util.find_spec(backend) is None
                yield pytest.param(backend, ranks, cases, id=f"{backend}-{ranks}ranks", marks=[
                    pytest.mark.skipif(missing, reason=f"{backend} is not installed")])


@pytest.fixture(scope="module")
def serial_runs(scratch):
    """serial(backend, cases): the folder of the worker's serial results on that backend."""
    done = set()

    def serial(backend, cases):
        out = scratch / f"input-shapes-serial-{backend}"
        wanted = [case for case in cases if (backend, case) not in done]
        if wanted:
            out.mkdir(exist_ok=True)
            assert_ok(run_python(WORKER, "--mode", "serial", "--out", out, "--cases", ",".join(wanted),
                                 env={"KERAS_BACKEND": backend}))
            done.update((backend, case) for case in wanted)
        return out
    return serial


@pytest.mark.parametrize("backend, ranks, cases", list(chosen()))
def test_inputs_with_open_dimensions_train_like_serial_keras(backend, ranks, cases, serial_runs, scratch):
    serial_dir = serial_runs(backend, cases)
    out = scratch / f"input-shapes-{backend}-{ranks}ranks"
    out.mkdir()
    arguments = (WORKER, "--mode", "tnt", "--out", out, "--cases", ",".join(cases))
    env = {"KERAS_BACKEND": backend}
    assert_ok(run_python(*arguments, env=env, timeout=900) if ranks == 1 else
              launch(ranks, *arguments, env=env, timeout=900))
    assert_ranks_like_serial(serial_dir, out, cases, ranks, backend)
