"""The custom-training examples give the serial History on 2 ranks (rtol 1e-5)."""

import re

import numpy as np
import pytest

from conftest import REPO, assert_ok, launch, run_python

SHORT_RUNS = {
    "custom_train_step.py": ["--samples", "700", "--epochs", "2"],
    "gan.py": ["--samples", "700", "--epochs", "2"],
}


def history_in(output):
    found = dict(re.findall(r"^history (\w+): (.+)$", output, re.MULTILINE))
    return {key: np.array(values.split(), float) for key, values in found.items()}


@pytest.mark.parametrize("example", sorted(SHORT_RUNS))
def test_example_gives_the_serial_history_on_two_ranks(example):
    script = REPO / "examples" / example
    serial = run_python(script, *SHORT_RUNS[example], timeout=600)
    assert_ok(serial)
    distributed = launch(2, script, *SHORT_RUNS[example], timeout=600)
    assert_ok(distributed)
    expected, got = history_in(serial.stdout), history_in(distributed.stdout)
    assert expected and sorted(expected) == sorted(got), (serial.stdout, distributed.stdout)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    assert "trained on 2 rank(s)" in distributed.stdout
