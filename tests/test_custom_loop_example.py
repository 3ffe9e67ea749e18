"""examples/custom_loop.py trains to the same weights and losses on 1 and 2 ranks."""

import re

import numpy as np

from conftest import REPO, assert_ok, launch, run_python

EXAMPLE = REPO / "examples" / "custom_loop.py"


def epoch_losses(output):
    return [float(loss) for loss in re.findall(r"epoch \d+: mean loss ([\d.]+) over 999 samples", output)]


def test_custom_loop_example_trains_alike_on_one_and_two_ranks(tmp_path):
    serial = run_python(EXAMPLE, "--epochs", "2", "--save-weights", tmp_path / "serial.npz", timeout=300)
    assert_ok(serial)
    distributed = launch(2, EXAMPLE, "--epochs", "2", "--save-weights", tmp_path / "two.npz", timeout=300)
    assert_ok(distributed)
    assert "on 1 rank(s)" in serial.stdout and "on 2 rank(s)" in distributed.stdout
    serial_losses, distributed_losses = epoch_losses(serial.stdout), epoch_losses(distributed.stdout)
    assert len(serial_losses) == len(distributed_losses) == 2
    # Printed with 6 decimals: equal up to the last printed digit.
    np.testing.assert_allclose(distributed_losses, serial_losses, atol=2e-6)
    with np.load(tmp_path / "serial.npz") as one, np.load(tmp_path / "two.npz") as two:
        assert one.files == two.files and len(one.files) == 6
        for name in one.files:
            np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0)
