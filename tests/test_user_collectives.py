"""tnt.allreduce/broadcast/allgather/barrier against NumPy, and custom training loops against serial Keras.

One launcher run per rank count. The worker asserts every value (collectives exactly, or
within 1e-2 for 16-bit floats and 1e-6 otherwise; custom-loop weights within 1e-5 and losses
within 1e-5 relative of serial Keras) and prints a line per passed check.
"""

import re

import pytest

from conftest import WORKERS, assert_ok, launch

LOOP_VARIANTS = ["eager apply (mean)", "function apply_gradients (mean)", "eager allreduce_gradients (sum)"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_match_numpy_and_custom_loops_match_serial(ranks):
    process = launch(ranks, WORKERS / "user_collectives.py", timeout=300)
    assert_ok(process)
    for rank in range(ranks):
        checks = re.search(rf"rank {rank}: (\d+) collective checks agree with numpy", process.stdout)
        assert checks and int(checks.group(1)) > 500, process.stdout
        assert f"rank {rank}: structures, classes and broadcast_variables agree" in process.stdout
        assert f"rank {rank}: the original's classes return what the original's did" in process.stdout
        assert f"rank {rank}: bad input raised alike" in process.stdout
        assert f"rank {rank}: gradients combined as documented" in process.stdout
        for variant in LOOP_VARIANTS:
            assert f"rank {rank}: custom loop {variant} max weight error" in process.stdout, process.stdout
        assert f"rank {rank}: done" in process.stdout
