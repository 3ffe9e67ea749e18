"""Callbacks, saving and loading, batch-size options and input types, next to serial Keras.

Every scenario runs under the launcher; each rank trains with tarantella and, in the same
process, the serial Keras reference (see workers/keras_surface.py). Tolerances: weights atol
1e-5 and logs rtol 1e-5 against serial Keras, as in test_equivalence; save/resume atol 1e-6.
"""

import csv
import json

import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launch

WORKER = WORKERS / "keras_surface.py"


def run(scenario, tmp_path, ranks=2, env=None):
    process = launch(ranks, WORKER, scenario, tmp_path, env=env)
    assert_ok(process)
    results = [json.loads((tmp_path / f"{scenario}.rank{rank}.json").read_text()) for rank in range(ranks)]
    return results, process


def files_of(folder):
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()) \
        if folder.exists() else []


def assert_same_logs(got, expected):
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


# -- callbacks ---------------------------------------------------------------------------------

def test_deciding_and_writing_callbacks_act_as_in_serial_keras(tmp_path):
    results, _ = run("deciding_callbacks", tmp_path)
    for rank, result in enumerate(results):
        serial = result["serial_history"]
        assert len(serial["loss"]) < 30, "EarlyStopping must stop early for this test to mean anything"
        assert len(set(serial["learning_rate"])) > 3  # the scheduler and the plateau both acted
        assert_same_logs(result["history"], serial)  # so EarlyStopping stopped at the serial epoch
        assert result["learning_rate"] == pytest.approx(result["serial_learning_rate"], rel=1e-6)
        assert result["weights_difference"] < 1e-5 and result["best_checkpoint_difference"] < 1e-5, rank
    # One CSV file and one checkpoint, written by the master; the CSV holds the serial values.
    assert files_of(tmp_path / "rank0") == ["best.keras", "log.csv"]
    assert files_of(tmp_path / "rank1") == []
    with open(tmp_path / "rank0" / "log.csv") as mine, open(tmp_path / "serial" / "log.csv") as serial:
        rows, serial_rows = list(csv.DictReader(mine)), list(csv.DictReader(serial))
    assert len(rows) == len(serial_rows) == len(results[0]["history"]["loss"])
    for row, serial_row in zip(rows, serial_rows):
        assert row.keys() == serial_row.keys()
        np.testing.assert_allclose([float(v) for v in row.values()], [float(v) for v in serial_row.values()],
                                   rtol=1e-5)


def test_terminate_on_nan_stops_every_rank_at_the_serial_batch(tmp_path):
    results, _ = run("terminate_on_nan", tmp_path)
    for result in results:
        assert result["serial_epochs"] == 1 and len(result["serial_batches"]) < 5
        assert (result["batches"], result["epochs"]) == (result["serial_batches"], result["serial_epochs"])


def test_tensorboard_remote_monitor_and_progress_bar_act_on_the_master_only(tmp_path):
    results, process = run("writing_callbacks", tmp_path)
    assert [result["posts"] for result in results] == [[0, 1], []]
    assert any(path.startswith("tensorboard/train/events") for path in files_of(tmp_path / "rank0"))
    assert files_of(tmp_path / "rank1") == []
    assert process.stdout.count("Epoch 1/2") == 1  # one progress bar


def test_tensorboard_on_all_devices_writes_one_folder_per_rank(tmp_path):
    run("writing_callbacks", tmp_path, env={"TNT_TENSORBOARD_ON_ALL_DEVICES": "true"})
    for rank in range(2):
        assert any(path.startswith(f"tensorboard/rank_{rank}/train/events")
                   for path in files_of(tmp_path / f"rank{rank}")), rank


def test_wrapped_callbacks_run_where_asked_and_see_global_or_own_logs(tmp_path):
    results, _ = run("custom_callbacks", tmp_path)
    runs_on = {"default": [0, 1], "local_all": [0, 1], "global_master": [0], "local_master": [0]}
    for rank, result in enumerate(results):
        assert result["lambda_epochs"] == ([0, 1] if rank == 0 else [])
        for name, calls in result["calls"].items():
            if rank not in runs_on[name]:
                assert calls == [], (name, rank)
                continue
            expected = result["expected_local" if name.startswith("local") else "expected_global"]
            kinds = [kind for kind, _, _ in calls]
            assert kinds == (["train_batch"] * 4 + ["test_end", "epoch"]) * 2, (name, kinds)
            first_batch, validation, last_epoch = calls[0][2], calls[-2][2], calls[-1][2]
            np.testing.assert_allclose(first_batch["loss"], expected["first_batch_loss"], rtol=1e-5)
            np.testing.assert_allclose(validation["loss"], expected["val_loss"], rtol=1e-5)
            for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
                np.testing.assert_allclose(last_epoch[key], expected[key], rtol=1e-5, err_msg=(name, rank, key))
    # The ranks' own values differ from each other, so the check above can tell them apart.
    assert results[0]["expected_local"]["loss"] != pytest.approx(results[1]["expected_local"]["loss"])


def test_contradictory_wrapper_settings_are_refused(tmp_path):
    results, _ = run("wrapper_errors", tmp_path)
    for result in results:
        errors = result["errors"]
        assert all(errors), errors
        assert "EarlyStopping" in errors[0] and "must run on all ranks" in errors[0]
        assert "ReduceLROnPlateau" in errors[1]
        assert "already a tnt.keras.callbacks.Callback" in errors[2]
        assert "aggregate_logs must be True or False" in errors[3]
        assert "wraps a keras.callbacks.Callback" in errors[4]
        assert "write_in_background=True applies to keras.callbacks.ModelCheckpoint; got CSVLogger" in errors[5]


def test_backup_and_restore_resumes_every_rank_at_the_failed_epoch_in_its_sample_order(tmp_path):
    # Two ranks only: the order of the resumed epoch does not depend on the rank count.
    results, _ = run("backup_and_restore", tmp_path, ranks=2)
    for rank, by_kind in enumerate(results):
        assert sorted(by_kind) == ["arrays-shuffled", "dataset-reshuffled", "files-reshuffled", "pydataset-shuffled"]
        for kind, result in by_kind.items():
            assert result["backup_files"] == ["latest.weights.h5", "training_metadata.json"], kind
            assert result["epochs_run_after_restore"] == 1, kind  # epoch 3 of 3
            # Bit for bit the uninterrupted run: Adam's state restored, and epoch 3 sees the samples
            # in the order it has there (the third pass of the shuffle).
            assert result["difference"] == 0.0, (rank, kind, result["difference"])
            assert result["backup_removed"], kind


# -- saving and loading -------------------------------------------------------------------------

def test_training_resumed_from_a_save_equals_uninterrupted_training(tmp_path):
    results, _ = run("save_and_resume", tmp_path, ranks=2)
    for result in results:
        assert result["resumed_whole_difference"] <= 1e-6
        assert result["resumed_weights_difference"] <= 1e-6
        assert result["reference_vs_serial"] <= 1e-5
        assert result["loaded_before_compile_difference"] == 0.0
        assert result["trained_after_loading_before_compile_vs_serial"] <= 1e-5
        assert (result["loaded_type"], result["loaded_compiled"]) == ("Model", True)
        assert result["uncompiled"] == ["Model", False]
        assert result["plain_keras_reads_it"] == ["Functional", 0.0]
    # Only the master writes, except with tnt_save_all_devices=True; no partial file is left.
    assert results[0]["files"] == ["everywhere.keras", "model.keras", "model.weights.h5", "via_function.keras"]
    assert results[1]["files"] == ["everywhere.keras"]


def test_configs_clones_and_set_weights(tmp_path):
    results, _ = run("configs_and_weights", tmp_path)
    for result in results:
        for name in ("model_from_config", "from_config", "model_from_json", "clone_model"):
            assert result[name] == ["Model", 0], name
        # set_weights on the master alone: both ranks then hold and evaluate the master's weights.
        assert result["restored_difference"] == 0.0
        assert result["restored_evaluation"] == result["trained_evaluation"]
        # tnt.Sequential wraps a keras.Sequential and trains like it.
        assert result["sequential"] == ["Sequential", "Sequential", "Sequential"]
        difference, history, serial_history = result["sequential_vs_serial"]
        assert difference <= 1e-5
        assert_same_logs(history, serial_history)


def test_checkpoints_written_in_background_hold_each_epochs_serial_state(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    results, _ = run("background_checkpoints", tmp_path, env={"TMPDIR": str(staging)})
    for rank, result in enumerate(results):
        # Each file is the state at its epoch's end, though training went on while it was copied.
        assert len(result["differences"]) == 4 and max(result["differences"]) < 1e-5, (rank, result["differences"])
        assert result["iterations"] == 4 * 5  # 135 samples in batches of 32, the last epoch's file
        assert result["staged"] == []
    assert files_of(tmp_path / "rank0") == [f"epoch{epoch}.keras" for epoch in range(1, 5)]
    assert files_of(tmp_path / "rank1") == []


def test_a_background_save_returns_before_its_copy_and_appears_whole_after_it(tmp_path):
    results, _ = run("background_copy", tmp_path, ranks=1)
    assert results[0] == {"there_before_the_copy": False, "contents": "the whole file", "files": ["model.weights.h5"]}


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_background_save_holds_the_model_as_it_was_though_training_goes_on(tmp_path, backend):
    results, _ = run("background_snapshot", tmp_path, ranks=1, env={"KERAS_BACKEND": backend})
    result = results[0]
    # The thread wrote the Functional model's file from its host copy; the subclassed one was
    # written on the step. Either file holds the weights and Adam's state at the save.
    assert result["written_by_a_thread"] == ["Functional"]
    for kind in ("functional", "subclassed"):
        assert result[kind]["variables"] == 4 + 1 + 1 + 2 * 4, kind  # weights, Adam's counter and rate, slots
        assert result[kind]["difference_to_the_state_at_save"] == 0.0, kind
        assert result[kind]["difference_to_the_weights_after"] > 1e-4, kind  # it trained on meanwhile


def test_a_checkpoint_that_fails_in_the_background_stops_every_rank_naming_it(tmp_path, full_disk):
    process = launch(2, WORKER, "background_checkpoints", tmp_path, full_disk)
    assert process.returncode != 0
    # Raised on the master at the next checkpoint, told to rank 1 at its next collective.
    failure = (f"ModelCheckpoint on rank 0 failed: OSError: Writing the checkpoint {full_disk}/epoch1.keras in the "
               "background failed: [Errno 28] No space left on device")
    assert "rank 1 on host" in process.stderr and failure in process.stderr, process.stderr
    assert files_of(full_disk) == []  # no partial file left


def test_a_failed_save_keeps_the_old_file_and_raises_on_every_rank(tmp_path):
    results, _ = run("failed_save", tmp_path)
    assert results[0]["error"] == "disk full (simulated)"
    assert results[1]["error"].startswith("Saving ") and "failed on rank 0: OSError: disk full" in results[1]["error"]
    for result in results:
        assert result["unchanged"] and result["files"] == ["model.weights.h5"]


# -- batch-size options and inputs --------------------------------------------------------------

def test_micro_batch_options_numpy_dicts_and_pydataset_match_serial_keras(tmp_path):
    results, _ = run("batch_options", tmp_path)
    for result in results:
        for key in ("micro_batch_fit", "numpy_fit", "pydataset_fit"):
            difference, history, serial_history = result[key]
            assert difference < 1e-5, key
            assert_same_logs(history, serial_history)
        for key in ("micro_batch_evaluate", "numpy_evaluate", "pydataset_evaluate"):
            np.testing.assert_allclose(*result[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(result["micro_batch_batched"], result["micro_batch_evaluate"][1], rtol=1e-5)
        for key in ("micro_batch_predict", "numpy_predict", "pydataset_predict", "dict_fit"):
            assert result[key] < 1e-5, key
        assert "batched with 50 samples, but tnt_micro_batch_size=16 x 2 ranks = 32" in result["inconsistent_error"]


def test_manually_sharded_data_trains_like_serial_keras(tmp_path):
    results, process = run("manual_sharding", tmp_path, env={"TNT_LOG_LEVEL": "INFO"})
    assert all(result["weights_difference"] < 1e-5 for result in results)
    assert "automatic data distribution is off" in process.stdout + process.stderr


def test_manual_shards_with_different_step_counts_stop_with_the_counts(tmp_path):
    process = launch(2, WORKER, "manual_sharding_uneven", tmp_path, timeout=120)
    assert process.returncode != 0
    assert "different numbers of batches (rank 0: 3, rank 1: 4)" in process.stdout + process.stderr


# -- points to consider -----------------------------------------------------------------------------

def test_small_batch_normalization_micro_batches_warn_once(tmp_path):
    _, process = run("batch_normalization_warning", tmp_path)
    output = process.stdout + process.stderr
    assert output.count("micro-batches of 8 samples (global batch 16 over 2 ranks)") == 1
    assert output.count("BatchNormalization layers") == 1


def test_a_serial_model_sharing_layers_sees_the_trained_weights(tmp_path):
    results, _ = run("shared_layers", tmp_path)
    assert all(result["difference"] < 1e-5 for result in results)
