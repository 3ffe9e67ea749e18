"""The judging logic of benchmarks/scaling.py, on synthetic timings (no training, no timing)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "scaling.py"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", _PATH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scaling = _load("scaling")


def _measured(step_ms):
    """`step_ms`: {label: [window median per round]} as the workers report them."""
    agreements = {"c": 1, "d": 1, "e": 1}  # tarantella's agreement allreduces per step at 2 ranks
    return {
        "windows": {label: [{"median_step_seconds": ms / 1e3, "agreements_per_step": agreements.get(label)}
                            for ms in per_round] for label, per_round in step_ms.items()},
        "agreement": {"agreement_seconds": 10e-6, "collective_seconds": 50e-6},
    }


def test_ratios_are_paired_per_round_so_drift_cancels():
    # The machine slows down 3x over the run; (c) is always exactly 5% slower than (d) in the same round.
    drift = [1.0, 1.5, 2.0, 2.5, 3.0, 2.0, 1.2]
    step_ms = {"a": [100 * f for f in drift], "b": [101 * f for f in drift],
               "c": [105 * f for f in drift], "d": [100 * f for f in drift]}
    analysis = scaling.analyze("lenet5", _measured(step_ms))

    c_over_d = analysis["ratios"]["c/d"]
    assert c_over_d["median"] == pytest.approx(1.05)
    assert c_over_d["q1"] == pytest.approx(1.05) and c_over_d["q3"] == pytest.approx(1.05)
    assert c_over_d["verdict"] == "met"  # target 1.08
    assert analysis["ratios"]["b/a"]["median"] == pytest.approx(1.01)
    assert analysis["speed_up_c_over_a"]["median"] == pytest.approx(100 / 105)
    # Step times themselves carry the drift: median of the rounds, quartiles wide apart.
    assert analysis["step_seconds"]["d"]["median"] == pytest.approx(0.2)
    assert analysis["step_seconds"]["d"]["q3"] / analysis["step_seconds"]["d"]["q1"] > 1.5
    assert analysis["agreements_per_step"] == {"c": 1, "d": 1}


@pytest.mark.parametrize("per_round, verdict", [
    ([1.00, 1.01, 1.02, 1.03, 1.04, 1.05], "met"),                        # whole IQR below 1.08
    ([1.10, 1.12, 1.14, 1.15, 1.20, 1.25], "MISSED"),                     # whole IQR above
    ([0.95, 1.00, 1.07, 1.09, 1.15, 1.20], "spread too large to judge"),  # IQR straddles 1.08
])
def test_a_target_is_judged_only_when_the_spread_allows(per_round, verdict):
    step_ms = {"a": [100] * 6, "b": [100] * 6, "c": [100 * r for r in per_round], "d": [100] * 6}
    assert scaling.analyze("lenet5", _measured(step_ms))["ratios"]["c/d"]["verdict"] == verdict


def test_too_few_rounds_are_never_judged():
    step_ms = {"a": [100] * 2, "b": [100] * 2, "c": [300] * 2, "d": [100] * 2}
    assert scaling.analyze("lenet5", _measured(step_ms))["ratios"]["c/d"]["verdict"].startswith("too few rounds")


def test_resnet50_judges_synchronized_batch_normalization_against_plain_two_ranks():
    step_ms = {"a": [500] * 5, "b": [500] * 5, "c": [520] * 5, "d": [500] * 5, "e": [600] * 5}
    ratios = scaling.analyze("resnet50", _measured(step_ms))["ratios"]
    assert ratios["e/c"]["median"] == pytest.approx(600 / 520)
    assert ratios["e/c"]["verdict"] == "MISSED"  # target 1.10
    assert ratios["c/d"]["verdict"] == "met"


def test_compare_flags_runs_whose_ratios_differ_by_more_than_five_percent(tmp_path, capsys):
    step_ms = {"a": [100] * 5, "b": [100] * 5, "c": [110] * 5, "d": [100] * 5}
    paths = []
    for name, c_ms in [("first", 110), ("close", 114), ("far", 117)]:
        analysis = scaling.analyze("lenet5", _measured({**step_ms, "c": [c_ms] * 5}))
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"results": {"lenet5": {"analysis": analysis}}}))
    assert scaling.compare(paths[0], paths[1])      # (c)/(d) 1.10 against 1.14: 3.6% apart
    assert not scaling.compare(paths[0], paths[2])  # 1.10 against 1.17: 6.4% apart
    assert "lenet5      (c)/(d)        1.100       1.170        6.4%  more than 5% apart" in capsys.readouterr().out


def test_against_a_revision_judges_the_code_under_test_against_it_and_skips_missing_variants():
    # --against d6ca19e --variants c,@d6ca19e: no (a), (b), (d), so only (c)/(@d6ca19e) is judged.
    measured = _measured({"c": [110, 108, 112, 109, 111], "@d6ca19e": [100] * 5})
    measured["variants"] = {"c": {"description": "tarantella, 2 ranks", "ranks": 2},
                            "@d6ca19e": {"description": "tarantella at d6ca19e, 2 ranks", "ranks": 2}}
    analysis = scaling.analyze("lenet5", measured)
    assert list(analysis["ratios"]) == ["c/@d6ca19e"]
    ratio = analysis["ratios"]["c/@d6ca19e"]
    assert ratio["median"] == pytest.approx(1.10) and ratio["target"] == scaling.AGAINST_TARGET
    assert ratio["verdict"] == "MISSED"
    assert analysis["speed_up_c_over_a"] is None


def test_tarantella_is_judged_against_horovod_on_lenet5_and_the_mlp():
    step_ms = {"c": [90, 91, 89, 90, 92], "horovod": [100] * 5}
    for model, target, verdict in [("lenet5", 0.95, "met"), ("mlp", 0.90, "spread too large to judge")]:
        ratio = scaling.analyze(model, _measured(step_ms))["ratios"]["c/horovod"]
        assert ratio["median"] == pytest.approx(0.90) and ratio["target"] == target
        assert ratio["verdict"] == verdict


def test_without_a_horovod_environment_the_default_run_skips_the_variant_with_one_line(tmp_path):
    missing = tmp_path / "no-horovod"
    assert scaling.horovod_python(str(missing)) is None
    selected = scaling.select_variants("lenet5", None, {}, None, str(missing))
    assert list(selected) == ["a", "b", "c", "d"]
    script = os.path.relpath(_PATH.parent / "make_horovod_venv.sh")
    assert scaling.horovod_skipped(["lenet5", "resnet50"], None, None, str(missing)) == (
        f"horovod variant skipped: no Horovod environment at {missing}; build it with: bash {script} {missing}")
    assert scaling.horovod_skipped(["resnet50", "transformer"], None, None, str(missing)) is None  # not theirs
    assert scaling.horovod_skipped(["lenet5"], ["c", "d"], None, str(missing)) is None  # not asked for
    # Named explicitly, it cannot be skipped: the command stops before it measures anything.
    done = subprocess.run([sys.executable, str(_PATH), "--variants", "c,horovod", "--horovod-venv", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot time horovod: no Horovod environment at {missing}" in done.stderr


def test_a_built_horovod_environment_adds_the_variant_to_lenet5_and_the_mlp_only(tmp_path):
    venv = tmp_path / "horovod-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "horovodrun").touch(mode=0o755)
    horovod = scaling.horovod_python(str(venv))
    assert horovod == str(venv / "bin" / "python")
    assert list(scaling.select_variants("mlp", None, {}, horovod, str(venv))) == ["a", "b", "c", "d", "horovod"]
    selected = scaling.select_variants("lenet5", ["c", "horovod", "keras2", "keras2-split"], {}, horovod, str(venv))
    assert list(selected) == ["c", "horovod", "keras2", "keras2-split"]
    assert selected["c"].python is None  # this environment's
    assert all(selected[label].python == horovod for label in ("horovod", "keras2", "keras2-split"))
    assert selected["horovod"].ranks == 2 and selected["keras2"].ranks == 1 and selected["keras2-split"].ranks == 2
    assert selected["horovod"].stop_between_windows  # its background thread polls while it waits
    assert not selected["keras2-split"].stop_between_windows  # no Horovod: waits without CPU
    assert "horovod" not in scaling.select_variants("resnet50", None, {}, horovod, str(venv))
    with pytest.raises(ValueError, match="unknown variant"):
        scaling.select_variants("resnet50", ["c", "keras2"], {}, horovod, str(venv))
    with pytest.raises(ValueError, match="unknown variant"):
        scaling.select_variants("transformer", ["c", "horovod"], {}, horovod, str(venv))


def test_horovod_ranks_train_on_the_micro_batches_tarantella_would_give_them():
    worker = _load("scaling_worker")
    samples = np.arange(4 * 6).reshape(4 * 6, 1)  # 4 global batches of 6
    shares = [worker.rank_share(samples, 6, rank, 2) for rank in range(2)]
    for batch in range(4):
        assert np.concatenate([share[batch * 3:(batch + 1) * 3] for share in shares]).tolist() == \
            samples[batch * 6:(batch + 1) * 6].tolist()


def test_the_horovod_environment_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(_PATH.parent / "make_horovod_venv.sh")], check=True)


def test_the_two_rank_step_is_judged_against_compute_plus_a_bare_ring_allreduce_per_round():
    drift = [1.0, 2.0, 1.5, 3.0, 1.2]
    step_ms = {"c": [104 * f for f in drift], "d": [80 * f for f in drift], "ring": [20 * f for f in drift],
               "e": [115 * f for f in drift]}
    ratios = scaling.analyze("resnet50", _measured(step_ms))["ratios"]
    assert ratios["c/d+ring"]["median"] == pytest.approx(1.04)
    assert ratios["c/d+ring"]["target"] == 1.03 and ratios["c/d+ring"]["verdict"] == "MISSED"
    assert ratios["e/c"]["target"] == 1.15 and ratios["e/c"]["verdict"] == "met"
    lenet5 = scaling.analyze("lenet5", _measured(step_ms))["ratios"]["c/d+ring"]
    assert lenet5["target"] == 1.05 and lenet5["verdict"] == "met"


def test_what_the_timeline_costs_is_judged_when_it_is_timed():
    step_ms = {"c": [100] * 5, "timeline": [101, 102, 101, 102, 101]}
    ratio = scaling.analyze("mlp", _measured(step_ms))["ratios"]["timeline/c"]
    assert ratio["target"] == scaling.TIMELINE_TARGET and ratio["verdict"] == "met"
    assert "timeline" not in scaling.select_variants("mlp", None, {}, None, "")
    assert list(scaling.select_variants("mlp", ["c", "timeline"], {}, None, "")) == ["c", "timeline"]


def test_the_worker_times_a_bare_ring_allreduce_of_the_gradient_bytes():
    """In one process (the ring itself then has no partner): the timing path runs and answers seconds."""
    worker = _load("scaling_worker")

    class Model:
        trainable_variables = [np.zeros((600, 600), np.float32)]  # 1.4 MB: the ring path
    assert worker.measure_bare_ring(Model(), 2) > 0


def test_a_setting_variant_runs_a_c_or_d_with_one_environment_setting_and_is_reported_against_it():
    selected = scaling.select_variants("mlp", ["c", "c+TNT_FUSION_THRESHOLD=1024", "d+TNT_BIND_CORES=false",
                                               "a+BENCHMARK_JIT_COMPILE=1"], {}, None, "")
    setting = selected["c+TNT_FUSION_THRESHOLD=1024"]
    assert setting.environment == (("TNT_FUSION_THRESHOLD", "1024"),) and setting.ranks == 2
    assert setting.worker_variant == "tarantella" and selected["c"].environment == ()
    assert selected["d+TNT_BIND_CORES=false"].worker_variant == "no-allreduce"
    serial_xla = selected["a+BENCHMARK_JIT_COMPILE=1"]
    assert serial_xla.worker_variant == "keras" and serial_xla.ranks == 1
    for malformed in ["c+TNT_FUSION_THRESHOLD", "b+TNT_FUSION_THRESHOLD=1", "c+=1", "c+1X=2"]:
        with pytest.raises(ValueError, match="unknown variant"):
            scaling.select_variants("mlp", ["c", malformed], {}, None, "")
    step_ms = {"c": [100] * 5, "d": [80] * 5, "c+TNT_BIND_CORES=false": [110] * 5, "d+TNT_BIND_CORES=false": [88] * 5,
               "c+TNT_FUSION_THRESHOLD=1024": [90, 91, 89, 90, 92]}
    ratios = scaling.analyze("mlp", _measured(step_ms))["ratios"]
    ratio = ratios["c+TNT_FUSION_THRESHOLD=1024/c"]
    assert ratio["median"] == pytest.approx(0.90) and ratio["verdict"] == "measured, not judged"
    # "d+NAME=VALUE" in a denominator is one variant, not (d) plus another
    assert ratios["d+TNT_BIND_CORES=false/d"]["median"] == pytest.approx(1.10)
    assert ratios["c+TNT_BIND_CORES=false/d+TNT_BIND_CORES=false"]["median"] == pytest.approx(1.25)
    assert ratios["c/d"]["median"] == pytest.approx(1.25) and "c+TNT_FUSION_THRESHOLD=1024/d" not in ratios


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_other_backends_time_lenet5_and_the_mlp_with_their_backend_set(backend):
    selected = scaling.select_variants("mlp", None, {}, None, "", backend)
    assert list(selected) == ["a", "b", "c", "d"]
    assert all(("KERAS_BACKEND", backend) in variant.environment for variant in selected.values())
    named = scaling.select_variants("lenet5", ["c", "d", "split", "c+TNT_FUSION_THRESHOLD=1024"], {}, None, "",
                                    backend)
    assert named["split"].ranks == 2
    assert named["c+TNT_FUSION_THRESHOLD=1024"].environment == (
        ("TNT_FUSION_THRESHOLD", "1024"), ("KERAS_BACKEND", backend))
    assert all(variant.environment == () for variant in scaling.select_variants("lenet5", None, {}, None, "").values())


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_tensorflow_only_variants_and_models_are_refused_on_other_backends(backend):
    for label in ["horovod", "keras2", "keras2-split", "e", "no-agreement"]:
        with pytest.raises(ValueError, match=f"TensorFlow-only or unknown; on {backend}"):
            scaling.select_variants("lenet5", ["c", label], {}, None, "", backend)
    for model in ["resnet50", "transformer"]:
        with pytest.raises(ValueError, match=f"{model} is timed on the TensorFlow backend only"):
            scaling.select_variants(model, None, {}, None, "", backend)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_earlier_revisions_and_the_timeline_are_timed_on_other_backends_too(backend):
    revision = scaling.VARIANTS["c"]._replace(description="tarantella at main", tarantella_folder="/tmp/main")
    selected = scaling.select_variants("lenet5", ["c", "timeline"], {"@main": revision}, None, "", backend)
    assert list(selected) == ["c", "timeline", "@main"]
    assert selected["@main"].tarantella_folder == "/tmp/main"
    assert all(("KERAS_BACKEND", backend) in variant.environment for variant in selected.values())


def test_an_unknown_backend_or_a_tensorflow_only_variant_stops_the_command_before_measuring():
    done = subprocess.run([sys.executable, str(_PATH), "--backend", "tensorflow,mxnet"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown backend(s) mxnet" in done.stderr
    done = subprocess.run([sys.executable, str(_PATH), "--backend", "jax", "--variants", "c,horovod"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "variant horovod is TensorFlow-only or unknown; on jax" in done.stderr


def _backend_results(c_over_d_per_round):
    """{backend: {"lenet5": analyzed}} where (d) takes 100 ms and (c) the given multiple in each round."""
    return {backend: {"lenet5": {"analysis": scaling.analyze("lenet5", _measured(
        {"c": [100 * r for r in per_round], "d": [100] * len(per_round)}))}}
        for backend, per_round in c_over_d_per_round.items()}


@pytest.mark.parametrize("jax_per_round, verdict", [
    ([1.10, 1.11, 1.12, 1.13, 1.14], "met"),                        # IQR 1.11-1.13 <= 1.10 * 1.04
    ([1.20, 1.21, 1.22, 1.23, 1.24], "MISSED"),                     # IQR 1.21-1.23 > 1.10 * 1.06
    ([1.10, 1.12, 1.15, 1.18, 1.20], "spread too large to judge"),  # IQR 1.12-1.18 straddles 1.144-1.166
])
def test_each_backends_c_over_d_is_judged_against_tensorflows_only_where_both_spreads_allow(jax_per_round, verdict):
    tensorflow_per_round = [1.03, 1.04, 1.05, 1.06, 1.07]
    compared = scaling.across_backends(_backend_results({"tensorflow": tensorflow_per_round, "jax": jax_per_round}))
    entry = compared["lenet5"]["jax"]
    assert entry["tensorflow_c/d"] == pytest.approx(1.05)
    assert entry["ratio"] == pytest.approx(jax_per_round[2] / 1.05)
    assert entry["target"] == scaling.BACKEND_TARGET and entry["verdict"] == verdict


def test_without_tensorflow_or_enough_rounds_no_backend_is_judged_against_it():
    assert scaling.across_backends(_backend_results({"jax": [1.1] * 5, "torch": [1.2] * 5})) == {}
    compared = scaling.across_backends(_backend_results({"tensorflow": [1.0] * 2, "torch": [1.0] * 2}))
    assert compared["lenet5"]["torch"]["verdict"].startswith("too few rounds")


def test_compare_reads_runs_per_backend_and_runs_written_before_backends(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": _backend_results({"tensorflow": [1.10] * 5})["tensorflow"]}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"backends": ["tensorflow", "jax"],
                               "results": _backend_results({"tensorflow": [1.12] * 5, "jax": [1.30] * 5})}))
    assert scaling.compare(old, new)  # only TensorFlow is in both: 1.10 against 1.12
    out = capsys.readouterr().out
    assert "Keras backend: tensorflow" in out and "Keras backend: jax" not in out


def test_process_sets_split_the_rounds_among_fresh_workers_in_their_interleaved_order(monkeypatch, tmp_path):
    started = []

    class FakeWorker:
        """Answers as a worker would; each window's step time names its process set and round."""

        def __init__(self, model, label, variant, windows, steps, warmup, scratch):
            self.label, self.windows, self.answers = label, windows, []
            self.process_set = os.path.basename(scratch)
            started.append((label, windows, self.process_set))

        def send(self, command):
            self.answers.append(command)

        def receive(self, timeout_s):
            if not self.answers:  # the ready message
                return {"tarantella_folder": None, "ranks": 2, "parameters": 1, "global_batch_size": 8}
            command = self.answers[-1]
            if command == "window":
                return {"median_step_seconds": len(self.answers), "set": self.process_set}
            return {"agreement_seconds": None, "collective_seconds": None}

        def finish(self, timeout_s):
            return None

        def stop(self):
            pass

    monkeypatch.setattr(scaling, "Worker", FakeWorker)
    variants = {"c": scaling.Variant("tarantella, 2 ranks", 2, "tarantella"),
                "@main": scaling.Variant("at main", 2, "tarantella")}
    measured = scaling.measure_model("lenet5", variants, repeats=5, steps=1, warmup=0, scratch=str(tmp_path),
                                     process_sets=2)
    # 5 rounds: 2 in the first set of processes, 3 in the second, every variant started afresh.
    assert started == [("c", 2, "lenet5-set0"), ("@main", 2, "lenet5-set0"),
                       ("c", 3, "lenet5-set1"), ("@main", 3, "lenet5-set1")]
    assert [window["set"] for window in measured["windows"]["c"]] == ["lenet5-set0"] * 2 + ["lenet5-set1"] * 3
    assert len(measured["windows"]["@main"]) == 5 and measured["process_sets"] == 2
