"""The conformance zoo: real model families train under tarantella as under serial Keras.

tests/workers/zoo.py trains every case serially (plain Keras) and under tnt.Model on 2 ranks,
and a subset on 3, each rank count in one launcher run. Per case and rank count:
- every rank's weights and optimizer state are bitwise identical to rank 0's;
- weights and optimizer state within atol 1e-5 of serial Keras;
- History and evaluate within rtol 1e-5, predictions within rtol 1e-5 / atol 1e-6;
- a model saved on the ranks and read back with tnt.models.load_model predicts as serial.
Cases named `*-measured` are not serial-equal by design (dropout, BatchNormalization in
training mode, a layer that sums over the batch): their bound is the measured difference,
and docs/guide.md ("Models") quotes it.
"""

import os

import numpy as np
import pytest

from conftest import WORKERS, launch, load_npz, run_python
from workers.zoo import CASES

WORKER = WORKERS / "zoo.py"
RUN_TIMEOUT_S = 3600  # a last resort: the worker's watchdog ends a hung case after 600 s

# (case, ranks) -> the failure measured on the current code. strict: a fix flips them, and then
# its entry goes. The zoo's first run found 25 (Embedding, Dense on 3-D inputs, layer-owned
# metrics, empty Conv2D micro-batches, predict_on_batch, ScheduleFreeAdamW); all are fixed.
KNOWN_FAILURES = {}


def outcome(out, case, rank):
    for suffix in ("npz", "error"):
        if (out / f"{case}.rank{rank}.{suffix}").exists():
            return suffix
    return None


def run_zoo(ranks, out, cases):
    """Runs the cases; a run that dies (ranks disagreed, a hang) is started again with the cases left."""
    out.mkdir()
    pending = list(cases)
    runs = []
    while pending:
        arguments = ("--mode", "serial" if ranks == 0 else "tnt", "--out", out, "--cases", ",".join(pending))
        process = run_python(WORKER, *arguments, timeout=RUN_TIMEOUT_S) if ranks == 0 else \
            launch(ranks, WORKER, *arguments, timeout=RUN_TIMEOUT_S)
        runs.append(process)
        counted = max(ranks, 1)
        done = [c for c in pending if all(outcome(out, c, r) for r in range(counted))]
        left = [c for c in pending if c not in done]
        assert not (left and process.returncode == 0), f"the run ended well but skipped {left}:\n{process.stderr}"
        if left and not done:
            # The run died in the first case left without a result from every rank: that is its result.
            died_in = left[0]
            for rank in range(counted):
                if outcome(out, died_in, rank) is None:
                    (out / f"{died_in}.rank{rank}.error").write_text(
                        f"the run ended (exit {process.returncode}) without a result of rank {rank}\n"
                        f"stderr:\n{process.stderr[-3000:]}")
            left = left[1:]
        pending = left
    return runs


@pytest.fixture(scope="module")
def zoo_runs(scratch):
    """Runs each rank count once, for all its cases, on first use."""
    runs = {}

    def get(ranks):
        if ranks not in runs:
            out = scratch / f"zoo{ranks}"
            cases = [c for c in selected_cases() if ranks == 0 or ranks in ranks_of(c)]
            run_zoo(ranks, out, cases)
            runs[ranks] = out
        return runs[ranks]
    return get


def result(out, case, rank):
    error = out / f"{case}.rank{rank}.error"
    if error.exists():
        pytest.fail(f"{case} on rank {rank} raised: {error.read_text()}", pytrace=False)
    return load_npz(out / f"{case}.rank{rank}.npz")


# The default run: one case of each kind of failure the zoo has found, within the suite's time
# budget (masks and layer-owned metrics: tests/test_real_models.py on 2 and 3 ranks).
# TNT_ZOO_CASES=all runs all 74 cases, e.g. before a release.
DEFAULT_CASES = (
    "mobilenetv3small-frozen-backbone", "transformer-encoder-classifier",
    "recommender-subclassed-per-sample-dot", "conv2d-empty-micro-batch",
    "on-batch-methods", "global-clipnorm-clips-the-sum", "optimizer-adam-gradient-accumulation",
    "optimizer-schedule-free-adamw", "mixed-float16-loss-scale", "textvectorization-into-embedding",
    "batch-then-map-drop-remainder", "batch-then-padded-batch-map-drop-remainder",
    "distiller-train-step-without-call",
)


# Of those, the default run repeats on 3 ranks (uneven micro-batches) only the ones whose
# combination no other 3-rank test covers; tests/test_real_models.py runs masks, sparse
# gathers and empty micro-batches on 3 ranks.
DEFAULT_THREE_RANK_CASES = ("recommender-subclassed-per-sample-dot", "conv2d-empty-micro-batch",
                            "on-batch-methods", "batch-then-padded-batch-map-drop-remainder",
                            "distiller-train-step-without-call")


def ranks_of(case):
    """The rank counts a case runs on: all its own with TNT_ZOO_CASES set, else the default's."""
    ranks = CASES[case].ranks
    if os.environ.get("TNT_ZOO_CASES") or case in DEFAULT_THREE_RANK_CASES:
        return ranks
    return tuple(r for r in ranks if r != 3)


def selected_cases():
    """TNT_ZOO_CASES=name,name runs only those cases, =all every case; unset, DEFAULT_CASES."""
    wanted = os.environ.get("TNT_ZOO_CASES")
    if wanted == "all":
        return list(CASES)
    chosen = wanted.split(",") if wanted else DEFAULT_CASES
    return [case for case in CASES if case in chosen]


def parameters():
    for case in selected_cases():
        for ranks in ranks_of(case):
            reason = KNOWN_FAILURES.get((case, ranks))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(case, ranks, id=f"{case}-{ranks}ranks", marks=marks)


@pytest.mark.parametrize("case,ranks", list(parameters()))
def test_zoo_case_trains_like_serial_keras(case, ranks, zoo_runs):
    serial = result(zoo_runs(0), case, 0)
    out = zoo_runs(ranks)
    per_rank = [result(out, case, rank) for rank in range(ranks)]
    tolerance = CASES[case].tolerance
    weights_atol, logs_rtol = tolerance.get("weights", 1e-5), tolerance.get("logs", 1e-5)
    for rank, results in enumerate(per_rank):
        assert sorted(results) == sorted(k for k in serial if k != "clip_sensitivity"), (case, rank)
        for key in results:
            context = f"case {case}, rank {rank} of {ranks}, {key} {CASES[case].note}"
            if key.startswith(("weight_", "optimizer_")):
                np.testing.assert_array_equal(results[key], per_rank[0][key], err_msg=context + " vs rank 0")
                np.testing.assert_allclose(results[key], serial[key], rtol=0, atol=weights_atol, err_msg=context)
            elif key.startswith("loaded_predictions_"):
                reference = serial[key.replace("loaded_", "")]
                np.testing.assert_allclose(results[key], reference, rtol=logs_rtol, atol=1e-6, err_msg=context)
            else:
                np.testing.assert_allclose(results[key], serial[key], rtol=logs_rtol, atol=1e-6, err_msg=context)
    if "clip_sensitivity" in serial:
        # The case can fail: clipping each half of a batch, then summing, is far from clipping the batch.
        assert serial["clip_sensitivity"] > 0.1
