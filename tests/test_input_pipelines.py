"""A pipeline with random augmentation (stateless, seeded per sample, as docs/guide.md recommends)
trains on 2 and 3 ranks to the weights and logs of serial Keras: each rank augments only its own
samples, and draws what a serial run draws. So does, in the same runs, an interleave of TFRecord
files of uneven sizes (each rank reads only its own records; the dataset's length is unknown,
so Keras learns it from the end of the data). Tolerances: weights atol 1e-5, logs
rtol 1e-5."""

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launch, run_python

WORKER = WORKERS / "augmentation.py"


def load(path):
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


@pytest.fixture(scope="module")
def serial(scratch):
    out = scratch / "augmentation-serial"
    out.mkdir()
    (scratch / "augmentation-records").mkdir()
    assert_ok(run_python(WORKER, "--mode", "serial", "--out", out, "--records", scratch / "augmentation-records"))
    return load(out / "augmentation.rank0.npz")


@pytest.mark.parametrize("ranks", [2, 3])
def test_random_augmentation_trains_like_serial_keras(ranks, serial, scratch):
    out = scratch / f"augmentation-{ranks}"
    out.mkdir()
    assert_ok(launch(ranks, WORKER, "--mode", "tnt", "--out", out, "--records", scratch / "augmentation-records"))
    for rank in range(ranks):
        result = load(out / f"augmentation.rank{rank}.npz")
        assert sorted(result) == sorted(serial)
        for key, expected in serial.items():
            context = f"rank {rank} of {ranks}, {key}"
            if "weight_" in key:
                np.testing.assert_allclose(result[key], expected, rtol=0, atol=1e-5, err_msg=context)
            else:
                np.testing.assert_allclose(result[key], expected, rtol=1e-5, err_msg=context)
