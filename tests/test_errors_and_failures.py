"""Bad input raises a clear error on every rank; a failing rank ends the whole job quickly."""

import ast
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
        "numpy input": "TypeError: tnt.Model.fit expects a tf.data.Dataset",
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


def test_batchnorm_with_ranks_that_get_no_samples_stays_finite_and_identical():
    process = launch(3, SCENARIOS, "batchnorm-empty-micro-batches", timeout=300)
    assert_ok(process)
    results = {line.split(": ", 1)[1] for line in process.stdout.splitlines() if line.startswith("rank ")}
    assert len(results) == 1, f"ranks disagree: {results}"
    assert "nan" not in results.pop().lower()


def test_predict_of_an_uncompiled_model_returns_every_row_in_order_on_every_rank():
    process = launch(3, SCENARIOS, "predict-uncompiled-dict-outputs", timeout=300)
    assert_ok(process)
    for rank in range(3):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        assert "('a', (23, 2)), ('b', (23, 3))" in line
        differences = ast.literal_eval(line.split("differences ")[1])
        assert max(differences.values()) < 1e-6, line


def test_xla_with_several_ranks_warns_and_trains_without_it():
    process = launch(2, SCENARIOS, "xla-requested", timeout=300)
    assert_ok(process)
    assert "jit_compile=True is ignored with 2 ranks" in process.stderr
    assert "rank 0: jit_compile False" in process.stdout and "rank 1: jit_compile False" in process.stdout
