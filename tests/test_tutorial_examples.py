"""The tutorial examples (examples/resnet50.py, examples/transformer.py) give the serial
History on 2 ranks, and the ResNet callbacks' files are written once, by the master."""

import csv
import json

import h5py
import numpy as np
import pytest

from conftest import WORKERS, assert_ok, launch, run_python

WORKER = WORKERS / "tutorials.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reduced examples, serially (plain python) and on 2 ranks (the launcher)."""
    serial, distributed = tmp_path_factory.mktemp("serial"), tmp_path_factory.mktemp("two_ranks")
    assert_ok(run_python(WORKER, serial, timeout=300))
    assert_ok(launch(2, WORKER, distributed, timeout=300))
    return serial, distributed


def results(folder, example):
    return json.loads((folder / f"{example}.json").read_text())


def assert_same_history(serial, distributed):
    assert serial.keys() == distributed.keys()
    for key in serial:
        np.testing.assert_allclose(distributed[key], serial[key], rtol=1e-5, atol=0, err_msg=key)


@pytest.mark.parametrize("example", ["resnet50", "transformer"])
def test_two_ranks_give_the_serial_history(runs, example):
    serial, distributed = (results(folder, example) for folder in runs)
    assert (serial["ranks"], distributed["ranks"]) == (1, 2)
    assert_same_history(serial["history"], distributed["history"])


def test_resnet_trains_and_validates_with_the_scheduled_optimizer(runs):
    serial, distributed = (results(folder, "resnet50") for folder in runs)
    assert {"loss", "sparse_categorical_accuracy", "val_loss", "val_sparse_categorical_accuracy"} <= \
        serial["history"].keys()
    np.testing.assert_allclose(distributed["weights_sum_of_squares"], serial["weights_sum_of_squares"], rtol=1e-5)


def test_transformer_translates_on_the_master_between_rounds(runs):
    serial, distributed = (results(folder, "transformer") for folder in runs)
    assert len(serial["history"]["loss"]) == 2  # two rounds of one epoch, continued with initial_epoch
    assert len(serial["exact_translations"]) == len(distributed["exact_translations"]) == 2
    assert serial["exact_translations"] == distributed["exact_translations"]
    # The serial translator shares the trained layers: the same tokens, greedily decoded.
    assert serial["last_translations"] == distributed["last_translations"]
    assert len(serial["last_translations"]) == 4 and any(any(row) for row in serial["last_translations"])


def test_tfrecord_input_of_unknown_length_logs_the_serial_values(runs):
    serial, distributed = (results(folder, "tfrecords") for folder in runs)
    assert min(serial["history"]["loss"]) > 0 and serial["evaluate"][0] > 0
    assert_same_history(serial["history"], distributed["history"])
    np.testing.assert_allclose(distributed["evaluate"], serial["evaluate"], rtol=1e-5, atol=0)


def test_resnet_callback_files_are_written_once_by_the_master(runs):
    for folder in runs:
        output = folder / "resnet50_output"
        history = results(folder, "resnet50")
        assert sorted(p.name for p in output.iterdir()) == ["checkpoint.weights.h5", "tensorboard",
                                                            "training_log.csv"]
        # One events file per TensorBoard folder: a second writing rank would add its own.
        for run in ("train", "validation"):
            assert len(list((output / "tensorboard" / run).glob("events.out.tfevents.*"))) == 1, run
        assert not list((output / "tensorboard").glob("rank_*"))
        with open(output / "training_log.csv") as log:
            rows = list(csv.DictReader(log))
        assert len(rows) == 1
        for key, values in history["history"].items():
            assert float(rows[0][key]) == pytest.approx(values[0], rel=1e-6), key
        # The last checkpoint holds the final weights (moving statistics included).
        with h5py.File(output / "checkpoint.weights.h5") as checkpoint:
            arrays = []
            checkpoint["layers"].visititems(lambda name, item: arrays.append(item[()])
                                            if isinstance(item, h5py.Dataset) else None)
        squares = sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)
        assert squares == pytest.approx(history["weights_sum_of_squares"], rel=1e-6)
