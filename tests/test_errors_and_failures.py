"""Bad input raises a clear error on every rank; a failing rank ends the whole job quickly."""

import time

import pytest

from conftest import WORKERS, assert_ok, launch

SCENARIOS = WORKERS / "scenarios.py"


def test_each_bad_input_gets_the_same_clear_error_on_every_rank():
    process = launch(2, SCENARIOS, "bad-inputs", timeout=300)
    assert_ok(process)
    expected = {
        "fit before compile": "RuntimeError: Call model.compile",
        "Ftrl": "ValueError: tnt.Model does not support the Ftrl optimizer",
        "generator input": "TypeError: tnt.Model.fit takes a tf.data.Dataset, NumPy arrays",
        "numpy with a wrong micro-batch": "ValueError: batch_size=5 is the global batch, but "
                                          "tnt_micro_batch_size=4 x 2 ranks = 8",
        "batch_size with dataset": "ValueError: tnt.Model.fit: batch_size=16 cannot be combined",
        "unbatched dataset": "ValueError: The dataset is not batched",
    }
    for rank in (0, 1):
        for case, message in expected.items():
            assert f"rank {rank}: {case}: {message}" in process.stdout, process.stdout
    losses = {line.split()[-1] for line in process.stdout.splitlines() if "loss after errors" in line}
    assert len(losses) == 1, "both ranks trained together after the errors"


@pytest.mark.parametrize("scenario, message", [
    ("raise-on-rank-1", "rank 1 failed with RuntimeError"),
    ("kill-rank-1-mid-epoch", "Killed (signal 9)"),
])
def test_a_failing_rank_stops_the_whole_job_quickly(scenario, message):
    started = time.monotonic()
    process = launch(2, SCENARIOS, scenario, timeout=120)
    elapsed = time.monotonic() - started
    assert process.returncode != 0
    assert message in process.stderr + process.stdout
    assert "tarantella: the job failed" in process.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s (start-up included); the ranks must not wait for each other"


def test_ranks_with_different_models_fail_at_the_first_broadcast_naming_the_difference():
    process = launch(2, SCENARIOS, "different-models", timeout=120)
    assert process.returncode != 0
    assert "The model differs between ranks (ranks [1] differ from the master): variable #0 is ((6, 5)" \
        in process.stderr


def test_a_rank_waiting_for_a_collective_that_never_comes_times_out_naming_it():
    started = time.monotonic()
    process = launch(2, SCENARIOS, "uneven-steps", options=["-x", "TNT_COLLECTIVE_TIMEOUT=5"], timeout=120)
    assert process.returncode != 0
    assert "rank 1: the allreduce of batch sizes, losses and metrics did not complete within 5 s" in process.stderr
    assert time.monotonic() - started < 60


def test_a_fusion_threshold_that_is_not_a_number_is_refused():
    process = launch(2, SCENARIOS, "identity", options=["--fusion-threshold", "big"], timeout=60)
    assert process.returncode == 2
    assert "--fusion-threshold: expects a number of kilobytes >= 0, got 'big'" in process.stderr
    process = launch(2, SCENARIOS, "identity", options=["-x", "TNT_FUSION_THRESHOLD=big"], timeout=120)
    assert process.returncode != 0
    assert "TNT_FUSION_THRESHOLD='big' is not a number of kilobytes" in process.stderr
