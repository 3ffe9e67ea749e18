"""The pieces of benchmarks/emulated_cluster.py: the step model's arithmetic on a known schedule,
the profile model's stages and schedule, and a 2-host emulated run of a tiny profile model for a
few steps over a shaped link (needs root, `ip` and `tc`; skipped otherwise)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS / "cluster"))

import hosts as cluster_hosts  # noqa: E402
import profile_model  # noqa: E402
import step_model  # noqa: E402


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
    tf = pytest.importorskip("tensorflow")
    from tarantella import gradients
    rng = np.random.default_rng(1)
    sizes = [int(s) for s in rng.integers(1, 100_000, 200)]
    for threshold in (0, 1000, 32 * 1024, 1 << 20, 1 << 40):
        assert step_model.plan_buckets(sizes, threshold) == gradients.plan_buckets(sizes, [tf.float32] * 200, threshold)


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


def test_a_two_host_emulated_run_measures_every_variant(tmp_path):
    problem = cluster_hosts.available()
    if problem:
        pytest.skip(f"the emulated cluster {problem}")
    pytest.importorskip("mpi4py")
    profile_path = tmp_path / "tiny.json"
    profile_path.write_text(json.dumps(TINY_PROFILE))
    out = tmp_path / "run.json"
    process = subprocess.run(
        [sys.executable, str(BENCHMARKS / "emulated_cluster.py"), "run", "--models", str(profile_path),
         "--ranks", "2", "--links", "10gbe", "--repeats", "2", "--steps", "2", "--scale", "64",
         "--variants", "tnt,one-bucket,compute", "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    result = json.loads(out.read_text())["results"][str(profile_path)]["2"]
    assert result["measured"]["hosts"] == 2
    rows = result["analysis"]["10gbe"]
    compute = rows["compute"]["step"]["median"]
    # The profile's compute is 36 ms; the compute-only step waits for it and a little more.
    assert 0.036 <= compute < 0.5
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
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        cluster_hosts.PREFIX) == 0, "the run left namespaces behind"
