"""The pieces of benchmarks/emulated_cluster.py: the step model's arithmetic on a known schedule,
the profile model's stages and schedule, the profile model's waits and gradients on every Keras
backend and on Keras 2 (Horovod's environment, benchmarks/make_horovod_venv.sh: .venv-horovod in
the repository or HOROVOD_VENV; skipped where it is absent), the projection from a trace, the
shaped link's measured rate, and 2-host emulated runs of a tiny profile model for a few steps,
one of them with Horovod's job beside tarantella's (these need root, `ip` and `tc`; skipped
otherwise; the 2-host runs also need TNT_CLUSTER_TESTS=1, as each takes about a minute)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS / "cluster"))

import hosts as cluster_hosts  # noqa: E402
import profile_model  # noqa: E402
import step_model  # noqa: E402

HOROVOD_VENV = pathlib.Path(os.environ.get("HOROVOD_VENV", BENCHMARKS.parent / ".venv-horovod"))
HOROVOD_PYTHON = HOROVOD_VENV / "bin" / "python"


def horovod_python_or_skip():
    if not (HOROVOD_VENV / "bin" / "horovodrun").exists():
        pytest.skip(f"no Horovod environment at {HOROVOD_VENV} (bash benchmarks/make_horovod_venv.sh; or set "
                    "HOROVOD_VENV)")
    return str(HOROVOD_PYTHON)


def test_allreduce_costs_follow_the_textbook_formulas():
    alpha, beta = 10e-6, 1e9  # 10 us, 1 GB/s
    # ring: 2 (p-1) (alpha + s / (p beta)); 4 ranks, 4 MB: 6 x (10 us + 1 ms)
    assert step_model.ring_cost(4e6, 4, alpha, beta) == pytest.approx(6 * (10e-6 + 1e-3))
    # small message: recursive doubling, log2(8) = 3 steps of alpha + s / beta
    assert step_model.mpi_cost(8, 8, alpha, beta) == pytest.approx(3 * (10e-6 + 8e-9))
    # large message: Rabenseifner, 2 log2(p) alpha + 2 (p-1)/p s / beta
    assert step_model.mpi_cost(8e6, 8, alpha, beta) == pytest.approx(6 * 10e-6 + 2 * 7 / 8 * 8e-3)
    assert step_model.ring_cost(1e6, 1, alpha, beta) == 0.0
    # tarantella's choice: ring from 1 MiB on, MPI below
    assert step_model.bucket_cost(2 << 20, 4, alpha, beta) == step_model.ring_cost(2 << 20, 4, alpha, beta)
    assert step_model.bucket_cost(1000, 4, alpha, beta) == step_model.mpi_cost(1000, 4, alpha, beta)


def test_the_serial_worker_schedule_on_a_known_plan():
    # Backprop ends at 100 ms; buckets ready at 40, 70 and 100 ms, costing 20, 50 and 10 ms (ring, 2
    # ranks, no latency, 1 MB/s: cost = s / beta, so s = 20 kB, 50 kB, 10 kB).
    buckets = [(0.040, 20e3), (0.070, 50e3), (0.100, 10e3)]
    options = {"algorithm": "ring"}
    # Worker: 40-60, 70-120, 120-130 -> the step ends at 130 ms, plus a 5 ms tail.
    assert step_model.finish_time(buckets, 2, 0.0, 1e6, **options) == pytest.approx(0.130)
    assert step_model.predicted_step(0.100, buckets, 2, 0.0, 1e6, tail_s=0.005, **options) == pytest.approx(0.135)
    # The own limit: the last bucket's ready time plus its own cost: 100 + 10 ms.
    assert step_model.limit_step(0.100, buckets, 2, 0.0, 1e6, tail_s=0.005, **options) == pytest.approx(0.115)
    # Everything hidden: the step is the compute.
    assert step_model.predicted_step(0.100, [(0.040, 1e3)], 2, 0.0, 1e6, **options) == pytest.approx(0.100)


def test_the_plan_is_tarantellas():
    np = pytest.importorskip("numpy")
    try:
        from tarantella.backends.fusion import plan_buckets
    except ImportError:  # tarantella's layout before backends/
        pytest.importorskip("tensorflow")
        from tarantella.gradients import plan_buckets
    rng = np.random.default_rng(1)
    sizes = [int(s) for s in rng.integers(1, 100_000, 200)]
    for threshold in (0, 1000, 32 * 1024, 1 << 20, 1 << 40):
        assert step_model.plan_buckets(sizes, threshold) == plan_buckets(sizes, ["float32"] * 200, threshold)


def test_profile_stages_merge_weightless_layers_and_give_backprop_order_schedules():
    profile = {"model": "toy", "layers": [
        {"name": "pad", "weights": [], "forward_s": 0.001, "backward_s": 0.002},
        {"name": "conv", "weights": [[3, 3, 4, 8], [8]], "forward_s": 0.010, "backward_s": 0.020},
        {"name": "relu", "weights": [], "forward_s": 0.001, "backward_s": 0.001},
        {"name": "dense", "weights": [[8, 2]], "forward_s": 0.005, "backward_s": 0.010}]}
    stages = profile_model.stages(profile)
    assert [s[0] for s in stages] == ["conv", "dense"]
    assert stages[0][1] == [288, 8] and stages[0][2] == pytest.approx(0.012) and stages[0][3] == pytest.approx(0.023)
    compute, buckets = step_model.schedule(stages, threshold_bytes=0)
    assert compute == pytest.approx(0.017 + 0.033)
    # Backprop order: dense's kernel (ready at 17 + 10 ms), then conv's bias and kernel (at 50 ms).
    assert buckets == [(pytest.approx(0.027), 64), (pytest.approx(0.050), 32), (pytest.approx(0.050), 1152)]
    # Scaled by 8: sizes divided (at least one element), the same number of buckets.
    _, scaled = step_model.schedule(stages, threshold_bytes=0, scale=8)
    assert [n for _, n in scaled] == [8, 4, 144]


def test_the_shipped_profiles_have_the_real_models_weights():
    expected = {"resnet50": 25_583_592, "transformer_big": 209_977_344, "bert_base": 109_483_778,
                "vgg16": 138_357_544}
    for model, weights in expected.items():
        profile = profile_model.load(model)
        assert profile["parameters"] == weights
        assert sum(sum(s[1]) for s in profile_model.stages(profile)) == weights
        assert all(layer["forward_s"] > 0 for layer in profile["layers"] if layer["weights"])


TINY_PROFILE = {"model": "tiny", "batch": 1, "parameters": 3 * 262144 + 1024, "device": "made up", "layers": [
    {"name": f"dense{i}", "weights": [[512, 512]] + ([[1024]] if i == 0 else []), "forward_s": 0.004,
     "backward_s": 0.008} for i in range(3)]}


def skip_without_the_emulated_cluster():
    problem = cluster_hosts.available()
    if problem:
        pytest.skip(f"the emulated cluster {problem}")
    if os.environ.get("TNT_CLUSTER_TESTS") != "1":
        pytest.skip("set TNT_CLUSTER_TESTS=1 to run 2 ranks over emulated hosts (about a minute)")
    pytest.importorskip("mpi4py")


def run_tiny_profile(tmp_path, variants, *options):
    """emulated_cluster.py run of the tiny profile at 2 ranks on 10gbe, 2 rounds: (the process,
    the 2-rank result from its --json file)."""
    profile_path = tmp_path / "tiny.json"
    profile_path.write_text(json.dumps(TINY_PROFILE))
    out = tmp_path / "run.json"
    process = subprocess.run(
        [sys.executable, str(BENCHMARKS / "emulated_cluster.py"), "run", "--models", str(profile_path),
         "--ranks", "2", "--links", "10gbe", "--repeats", "2", "--steps", "2", "--scale", "64",
         "--variants", variants, "--json", str(out), *options],
        capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        cluster_hosts.PREFIX) == 0, "the run left namespaces behind"
    return process, json.loads(out.read_text())["results"][str(profile_path)]["2"]


def test_a_two_host_emulated_run_measures_every_variant(tmp_path):
    skip_without_the_emulated_cluster()
    _, result = run_tiny_profile(tmp_path, "tnt,one-bucket,compute", "--links", "ib,10gbe")
    assert result["measured"]["hosts"] == 2
    rows = result["analysis"]["10gbe"]
    compute = rows["compute"]["step"]["median"]
    # The profile's compute is 36 ms; the compute-only step waits for it and a little more.
    assert 0.036 <= compute < 0.5
    assert result["measured"]["backend"] == "tensorflow"
    for label in ("tnt", "one-bucket"):
        assert len(rows[label]["per_round"]) == 2
        assert rows[label]["step"]["median"] >= 0.036
        assert 0 < rows[label]["efficiency"]["median"] <= 1.2
        assert rows[label]["limit"]["median"] >= compute * 0.99
    # 3 MB of gradients over a 10 Gb/s link: one bucket after backprop costs at least the ring's
    # bandwidth term, 2 (p-1)/p x 3.1 MB / 1.25 GB/s = 2.5 ms, more than the overlapped default.
    assert rows["one-bucket"]["buckets"] == 1 and rows["tnt"]["buckets"] > 1
    assert rows["one-bucket"]["limit"]["median"] - compute > 0.0025
    probe = result["measured"]["probes"]["10gbe"]
    assert 0 < probe["sendrecv_s"] < 0.05 and probe["ring_s"] > 0
    # On each link tarantella measured the rate as shaped (nominal: times the byte scale) and chose
    # its threshold from it: larger on the faster link, whose transfers are shorter.
    chosen = {}
    for link, gbit in (("ib", 100), ("10gbe", 10)):
        probe = result["measured"]["probes"][link]
        measured = probe["tarantella_link"]
        assert 0.5 * gbit < measured["gbit"] < 1.1 * gbit, (link, measured)
        chosen[link] = probe["thresholds_kb"]["tnt"]
        assert chosen[link] * 1024 == step_model.automatic_threshold_bytes(2, 2, measured["latency_us"] * 1e-6,
                                                                           measured["gbit"] * 1e9 / 8)
        assert probe["thresholds_kb"]["one-bucket"] > 1 << 20
    assert chosen["ib"] > chosen["10gbe"]


def test_a_two_host_emulated_run_times_horovod_beside_tarantella(tmp_path):
    skip_without_the_emulated_cluster()
    horovod_python_or_skip()
    process, result = run_tiny_profile(tmp_path, "tnt,horovod,keras2,compute", "--horovod-venv", str(HOROVOD_VENV))
    rows = result["analysis"]["10gbe"]
    for label in ("tnt", "horovod", "keras2"):
        assert len(rows[label]["per_round"]) == 2
        assert rows[label]["step"]["median"] >= 0.036  # the profile's compute
        assert 0 < rows[label]["efficiency"]["median"] <= 1.2
    assert "limit" not in rows["horovod"]  # a peer: no fusion plan of tarantella's
    facts = result["measured"]["horovod"]
    # Horovod's default fusion threshold, 128 MiB, divided by the byte scale.
    assert facts["fusion_threshold_bytes"] == str((128 << 20) // 64)
    assert facts["versions"]["horovod"] == "0.28.1" and facts["versions"]["keras"].startswith("2.")
    # The ranks' local gradients differ (their own rows), and one step left every rank with -rate x
    # their mean: Horovod averaged them.
    check = facts["allreduce_check"]
    assert check["ok"] and check["ranks_differ"]
    assert check["weights"] == pytest.approx([-0.01 * sum(check["local_gradients"]) / 2] * 2, rel=1e-4)
    assert "tnt step / horovod step" in process.stdout


def test_a_two_host_emulated_run_times_keras_data_parallel_beside_tarantella_on_jax(tmp_path):
    """The keras-dp peer: Keras' DataParallel over JAX's distributed runtime, in the same job and
    rounds as tarantella on JAX; its ranks end with the same weights, as replicas must."""
    skip_without_the_emulated_cluster()
    pytest.importorskip("jax")
    _, result = run_tiny_profile(tmp_path, "tnt,keras-dp,compute", "--backend", "jax")
    assert result["measured"]["backend"] == "jax"
    rows = result["analysis"]["10gbe"]
    for label in ("tnt", "keras-dp"):
        assert len(rows[label]["per_round"]) == 2
        assert rows[label]["step"]["median"] >= 0.036  # the profile's compute
        assert 0 < rows[label]["efficiency"]["median"] <= 1.2
    assert "limit" not in rows["keras-dp"]  # a peer: no fusion plan of tarantella's


def test_a_two_host_emulated_run_times_gradient_accumulation_against_a_sum_every_step(tmp_path):
    """accumulate-2: tarantella with gradient_accumulation_steps=2, one sum per 2 micro-steps, its
    step the mean over whole cycles, judged per micro-step against `tnt`'s sum every step."""
    skip_without_the_emulated_cluster()
    process, result = run_tiny_profile(tmp_path, "tnt,accumulate-2,compute")
    rows = result["analysis"]["10gbe"]
    for label in ("tnt", "accumulate-2"):
        assert len(rows[label]["per_round"]) == 2
        assert rows[label]["step"]["median"] >= 0.036  # the profile's compute
    assert "limit" not in rows["accumulate-2"]  # its schedule has no round on half its micro-steps
    for windows in result["measured"]["windows"]["10gbe"]["accumulate-2"]:
        assert windows["median_step_seconds"] == pytest.approx(sum(windows["steps"]) / len(windows["steps"]))
    assert "accumulate-2 step / tnt step, per micro-step" in process.stdout


def test_an_accumulation_variant_must_time_whole_cycles():
    process = subprocess.run(
        [sys.executable, str(BENCHMARKS / "emulated_cluster.py"), "run", "--variants", "tnt,accumulate-4",
         "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert process.returncode != 0
    assert "accumulate-4: K must be an integer of at least 2 that divides --steps (2)" in process.stderr


TWO_STAGES = {"model": "two", "batch": 1, "parameters": 0, "device": "made up", "layers": [
    {"name": "a", "weights": [[40, 3], [3]], "forward_s": 0.003, "backward_s": 0.005},
    {"name": "b", "weights": [[4, 4]], "forward_s": 0.002, "backward_s": 0.007}]}

CHECK_ONE_STEP = """
import json, sys
sys.path.insert(0, sys.argv[1])
import keras
import numpy as np
import profile_model
profile = json.loads(sys.argv[2])
model = profile_model.build(profile, scale=4)
model.compile(keras.optimizers.SGD(1.0), "mse", jit_compile=False)
x, y = profile_model.data(2, steps=1)
x = np.arange(8, dtype=np.float32).reshape(2, 4) / 10
model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)  # traced and run before the waits are recorded
waits = []
profile_model.on_wait = lambda what, seconds: waits.append([what[0], what[1], seconds])
model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
print(json.dumps({"backend": keras.backend.backend(), "keras": keras.__version__, "waits": waits,
                  "weights": [np.asarray(w).tolist() for w in model.get_weights()]}))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch", "keras2"])
def test_the_profile_model_waits_in_backprop_order_and_makes_real_gradients(backend):
    """On every Keras 3 backend, and on Keras 2 (tf.keras of TensorFlow 2.15) in Horovod's
    environment, where the horovod variant runs it: the same waits, weights and gradients."""
    python = sys.executable
    if backend == "keras2":
        python = horovod_python_or_skip()
    elif importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    environment = {**os.environ, "KERAS_BACKEND": "tensorflow" if backend == "keras2" else backend,
                   "TF_CPP_MIN_LOG_LEVEL": "3"}
    process = subprocess.run([python, "-c", CHECK_ONE_STEP, str(BENCHMARKS / "cluster"), json.dumps(TWO_STAGES)],
                             capture_output=True, text=True, timeout=120, env=environment)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["backend"] == ("tensorflow" if backend == "keras2" else backend)
    assert result["keras"].startswith("2." if backend == "keras2" else "3.")
    # One training step (the second: the first may call the model once more to build Keras' loss):
    # each stage's forward, then the backward passes in reverse order, each for its profile time.
    assert result["waits"] == [["stage0", "forward", 0.003], ["stage1", "forward", 0.002],
                               ["stage1", "backward", 0.007], ["stage0", "backward", 0.005]]
    # The weights are the real ones divided by the byte scale (120 -> 30, 3 -> 1, 16 -> 4), and each
    # gradient element is 1e-6 times the mean of the loss gradient that reached the stage. The
    # stages pass the input through, so with MSE against zeros the loss gradient is 2 x / 8 per
    # entry: its mean is 2 sum(x) / 64, and each of the two SGD steps at rate 1 adds -1e-6 times that.
    assert [len(w) for w in result["weights"]] == [30, 1, 4]
    x_sum = sum(range(8)) / 10
    expected = 2 * -1e-6 * 2 * x_sum / 64
    for weight in result["weights"]:
        assert weight == pytest.approx([expected] * len(weight), rel=1e-5)


def test_a_shaped_link_carries_the_profiles_rate(tmp_path):
    problem = cluster_hosts.available()
    if problem:
        pytest.skip(f"the emulated cluster {problem}")
    netprobe = str(BENCHMARKS / "cluster" / "netprobe.py")
    rate_bit = 40e6  # 40 Mb/s: 1.5 MB take 0.3 s
    with cluster_hosts.EmulatedHosts(2, str(tmp_path)) as emulated:
        server = subprocess.Popen(emulated.exec_in(0, [sys.executable, netprobe, "serve", "5555"]))
        try:
            time.sleep(0.5)

            def stream():
                return float(subprocess.run(emulated.exec_in(1, [sys.executable, netprobe, "stream",
                                                                 emulated.addresses[0], "5555", str(1_500_000)]),
                                            capture_output=True, text=True, check=True, timeout=60).stdout)
            unshaped = stream()
            emulated.shape(rate_bit)
            shaped = stream()
        finally:
            server.kill()
            server.wait()
    # TCP's payload rate under tbf: at most the set rate, and at least 80% of it (headers, slow start).
    assert 0.8 * rate_bit / 1e9 <= shaped <= 1.02 * rate_bit / 1e9
    assert unshaped > 5 * shaped
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        emulated.prefix) == 0


def _saved_run(path, labels, efficiency):
    """A saved `run --json` file of one model at 2 ranks on 10gbe, `labels` timed (compute too)."""
    def row(value):
        spread = {"median": value, "q1": value, "q3": value}
        return {"step": spread, "efficiency": spread, "per_round": [value], "efficiency_per_round": [value]}
    rows = {"compute": row(0.05), **{label: row(efficiency[label]) for label in labels}}
    results = {"tiny": {"2": {"measured": {"hosts": 2, "probes": {}}, "analysis": {"10gbe": rows}}}}
    path.write_text(json.dumps({"links": ["10gbe"], "labels": ["compute", *labels], "results": results}))
    return str(path)


def test_report_merges_runs_that_timed_different_variants(tmp_path):
    """A later run of other variants (Horovod's, say) joins an earlier run's report: each cell where
    it was timed, blank where not; a later file's configuration replaces an earlier one's."""
    first = _saved_run(tmp_path / "a.json", ["tnt", "fusion-32"], {"tnt": 0.91, "fusion-32": 0.72})
    second = _saved_run(tmp_path / "b.json", ["tnt", "horovod"], {"tnt": 0.93, "horovod": 0.88})
    plotted = importlib.util.find_spec("matplotlib") is not None  # the plot extra
    plot = ["--plot", str(tmp_path / "merged.png")] if plotted else []
    process = subprocess.run([sys.executable, str(BENCHMARKS / "emulated_cluster.py"), "report", first, second, *plot],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    summary = process.stdout.split("Efficiency per variant")[1]
    header = next(line for line in summary.splitlines() if line.startswith("| model"))
    assert [cell.strip() for cell in header.split("|")[5:8]] == ["tnt", "fusion-32", "horovod"], header
    data = next(line for line in summary.splitlines() if line.startswith("| tiny"))
    cells = [cell.strip() for cell in data.split("|")[5:8]]
    # the tiny model's only configuration is the second run's: fusion-32 was not timed in it
    assert cells == ["0.93 (0.93-0.93)", "", "0.88 (0.88-0.88)"], data
    assert not plotted or (tmp_path / "merged.png").stat().st_size > 0
