"""Edge cases across ranks: empty micro-batches, uncompiled predict, XLA requests."""

import ast
import importlib.util
import re

import pytest

from conftest import WORKERS, assert_ok, launch

SCENARIOS = WORKERS / "scenarios.py"


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


def test_xla_asked_for_on_several_ranks_is_kept_and_answers_as_asked():
    """compile(jit_compile=True) on 2 ranks: XLA compiles the step between its collectives, and the
    model says jit_compile True. Set after compile, as a Keras user may, it holds the same way; and
    False turns it off. (The equality with serial Keras under XLA is tests/test_equivalence.py's.)"""
    process = launch(2, SCENARIOS, "xla-requested", timeout=300)
    assert_ok(process)
    assert "ignored" not in process.stderr
    for rank in range(2):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        assert line.startswith(f"rank {rank}: jit_compile True loss ") and line.endswith(
            " set after compile: True, then False"), line


def test_on_batch_methods_and_one_image_predict_equal_serial_keras():
    process = launch(2, SCENARIOS, "on-batch-methods", timeout=300)
    assert_ok(process)
    for rank in range(2):
        line = next(l for l in process.stdout.splitlines() if l.startswith(f"rank {rank}: "))
        numbers = line.split()
        assert float(numbers[3]) < 1e-5 and float(numbers[5]) < 1e-5, line  # weights, logs
        assert "predict_on_batch (7, 4)" in line and "one image (1, 4)" in line, line
        assert float(numbers[9]) < 1e-6 and float(numbers[14]) < 1e-6, line


def test_user_prints_appear_from_every_rank_and_keras_messages_once():
    process = launch(2, SCENARIOS, "user-prints", timeout=300)
    assert_ok(process)
    for rank in range(2):
        assert f"user print from rank {rank} epoch 0" in process.stdout, process.stdout
    assert process.stdout.count("early stopping") == 1, process.stdout


def test_numpy_inputs_warn_and_fail_as_keras_does():
    process = launch(2, SCENARIOS, "numpy-input-edges", timeout=300)
    assert_ok(process)
    for rank in range(2):
        assert f"rank {rank}: warnings []" in process.stdout, process.stdout
        assert f"rank {rank}: empty fit history {{}}" in process.stdout, process.stdout
        # Keras' own check and words: the arrays go to Keras' adapter as in a serial run
        assert f"rank {rank}: mismatch Data cardinality is ambiguous" in process.stdout
    assert "'x' sizes: 10\n'y' sizes: 9" in process.stdout


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_script_that_seeds_nothing_trains_every_rank_on_the_same_shuffled_batches(backend):
    """Without any seed, and with the ranks' generators made to differ, every rank still takes its
    rows of one and the same shuffled global batch: on TensorFlow through tarantella's own seeded
    shuffle of arrays, else through the master's generator states, which every rank takes."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    process = launch(2, SCENARIOS, "unseeded-shuffles", env={"KERAS_BACKEND": backend}, timeout=300)
    assert_ok(process)
    for rank in range(2):
        for name in ("arrays-shuffle-true", "arrays-shuffle-batch", "pydataset-reshuffled"):
            found = re.search(rf"rank {rank}: {name} differs from the unshuffled batch by (\S+)", process.stdout)
            assert found and float(found[1]) < 1e-5, (name, process.stdout[-3000:])


@pytest.mark.parametrize("loss, training_openings", [("mean", 0), ("sum", 10)])
def test_a_training_step_opens_in_its_gradient_round_unless_its_loss_needs_the_global_batch(loss, training_openings):
    """2 epochs of 5 steps, the last of 6 samples (3 ranks: 2 per rank, where every rank's guess
    of the global batch was 16), and 2 validation steps per epoch. A mean loss needs the global
    batch size only after backprop, so a training step's gradient round opens it; a sum loss
    needs it before, so the step opens with a collective of its own."""
    process = launch(3, SCENARIOS, "step-openings", loss, timeout=300)
    assert_ok(process)
    for rank in range(3):
        match = re.search(rf"rank {rank}: openings (\d+) rounds (\d+) weights differ by (\S+)", process.stdout)
        assert match, process.stdout
        assert int(match[1]) == training_openings + 2 * 2, match[0]
        assert int(match[2]) == 10, match[0]
        assert float(match[3]) < 1e-6, match[0]
