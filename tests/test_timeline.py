"""`tarantella --timeline FILE`: the trace of real ranks under the real launcher, the step report,
its straggler, and the report's advice on synthetic events."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import WORKERS, assert_ok, launch, launcher_command, quiet_env, run_python
from tarantella import timeline, timeline_projection, timeline_report
from tarantella.runtime.kinds import Collective

RANKS = 3


@pytest.fixture(scope="module")
def steady_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("timeline")
    trace_path = folder / "trace.json"
    process = launch(RANKS, WORKERS / "timeline.py", "steady", folder, options=["--timeline", str(trace_path)],
                     timeout=300)
    assert_ok(process)
    with open(trace_path) as file:
        trace = json.load(file)
    with open(folder / "facts.json") as file:
        facts = json.load(file)
    return process, trace, facts


def _slices(trace, rank, name_start=""):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank and e["name"].startswith(name_start)]


def _inside(event, outer):
    return outer["ts"] <= event["ts"] <= outer["ts"] + outer["dur"]


def test_the_trace_has_one_process_row_per_rank_on_one_clock(steady_run):
    _, trace, _ = steady_run
    named = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(named) == list(range(RANKS))
    assert all(named[rank].startswith(f"rank {rank} (") for rank in named)
    assert {e["pid"] for e in trace["traceEvents"]} == set(range(RANKS))
    clock = trace["otherData"]
    assert clock["ranks"] == RANKS and clock["clock_offsets_us"][0] == 0
    # One node, one CLOCK_MONOTONIC: each measured offset lies within its round trip.
    for offset, round_trip in zip(clock["clock_offsets_us"][1:], clock["clock_round_trips_us"][1:]):
        assert 0 < round_trip and abs(offset) <= round_trip
    # The same collective starts at about the same time everywhere (within the ranks' skew, not seconds).
    openings = [min(e["ts"] for e in _slices(trace, rank, "step opening")) for rank in range(RANKS)]
    assert max(openings) - min(openings) < 1e6


def test_every_training_step_shows_its_buckets_metrics_and_input(steady_run):
    _, trace, facts = steady_run
    for rank in range(RANKS):
        steps = _slices(trace, rank, "training step")
        assert len(steps) == facts["fit_steps"]
        buckets = _slices(trace, rank, "bucket ")
        metrics = [e for e in _slices(trace, rank, "losses and metrics") if e["tid"] == timeline_report.WORKER_ROW]
        for step in steps:
            inside = [b for b in buckets if _inside(b, step)]
            assert sum(b["args"]["bytes"] for b in inside) == facts["gradient_bytes"], step["name"]
            assert len([m for m in metrics if _inside(m, step)]) == 1
            assert [e for e in _slices(trace, rank, "waiting for input") if _inside(e, step)]
        handovers = [e for e in trace["traceEvents"] if e["pid"] == rank and e["name"].startswith("hand-over")]
        assert len(handovers) == len(buckets)
        # Every worker collective is split into its wait for the latest rank (if any) and its transfer.
        transfers = _slices(trace, rank, "transfer")
        assert len(transfers) == len([e for e in _slices(trace, rank) if "collective" in e["args"]])


def test_validation_saves_custom_loops_and_public_collectives_appear(steady_run):
    _, trace, _ = steady_run
    for rank in range(RANKS):
        assert _slices(trace, rank, "test step")
        assert _slices(trace, rank, "callbacks and Keras' loop")
        steps = _slices(trace, rank, "training step")
        outside = [b for b in _slices(trace, rank, "bucket ") if not any(_inside(b, s) for s in steps)]
        assert outside, "the custom loop's gradient buckets"
        assert [e for e in _slices(trace, rank, "tnt.allreduce") if e["tid"] == timeline_report.WORKER_ROW]
    assert _slices(trace, 0, "save model.keras")


def test_fit_prints_a_step_report_per_rank(steady_run):
    process, _, facts = steady_run
    report = process.stdout[process.stdout.index("tarantella timeline:"):]
    assert f"{facts['fit_steps'] - 1} training steps on {RANKS} rank(s)" in report
    assert "; fusion threshold 32 KB (automatic, one node);" in report.splitlines()[0]  # the ranks share one node
    for column in ("compute", "input wait", "communication not hidden", "waiting for the slowest rank"):
        assert column in report
    rows = [line.split() for line in report.splitlines()[2:2 + RANKS]]
    assert [row[0] for row in rows] == [str(rank) for rank in range(RANKS)]
    assert "What would help: " in report
    assert process.stdout.count("tarantella timeline:") == 1  # the master alone prints it


def test_a_rank_slowed_in_its_input_pipeline_is_named(tmp_path):
    process = launch(2, WORKERS / "timeline.py", "straggler", options=["--timeline", str(tmp_path / "t.json")],
                     timeout=300)
    assert_ok(process)
    assert "Straggler: rank 1 (host " in process.stdout, process.stdout
    assert "What would help: rank 1's input pipeline" in process.stdout, process.stdout


def test_a_forward_pass_compiled_by_xla_counts_as_compute_not_as_input_wait(tmp_path):
    """With XLA the forward pass is one operation, which TensorFlow's one inter-op thread may run
    before it takes the batch's arrival time; the step then waits for that timestamp."""
    process = launch(2, WORKERS / "timeline.py", "xla-convnet", options=["--timeline", str(tmp_path / "t.json")],
                     timeout=300)
    assert_ok(process)
    report = process.stdout[process.stdout.index("tarantella timeline:"):].splitlines()
    for row in (line.split() for line in report[2:4]):
        step_ms, compute_ms, input_ms = float(row[1]), float(row[2]), float(row[4])
        assert input_ms < 0.05 * step_ms and compute_ms > 0.5 * step_ms, report


def test_the_launcher_hands_the_timeline_to_every_rank(tmp_path):
    import subprocess
    command = launcher_command() + ["-n", "2", "--timeline", "trace.json", "--dry-run", "--", "train.py"]
    listing = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path).stdout
    assert f"TNT_TIMELINE={os.path.join(os.path.realpath(tmp_path), 'trace.json')}" in listing


# -- the report's advice, on synthetic events (times in ms) -----------------------------------------

MS = 1_000_000


def _rank_events(steps, blocked=(), buckets=(), slow_compute=0):
    """Events of one rank: `steps` training steps of 10 ms (+ slow_compute), each opening at 0.5 ms;
    `blocked`: (its Collective, start, end) in every step; `buckets`: bytes per step."""
    events, sequence, length = [("step", "training step", -50 * MS, -40 * MS, True)], 0, 10 + slow_compute
    for k in range(steps):
        start = k * 20 * MS
        events.append(("step", "training step", start, start + length * MS, False))
        events.append(("blocked", timeline_report.OPS_ROW, "STEP_OPENING", "the allreduce of micro-batch sizes of a training step",
                       start + MS // 2, start + MS // 2 + MS // 10))
        for kind, begin, end in blocked:
            events.append(("blocked", timeline_report.OPS_ROW, kind.name, kind.what, start + begin * MS, start + end * MS))
        for index, nbytes in enumerate(buckets):
            events.append(("bucket", sequence, index, nbytes, start + 2 * MS, start + 2 * MS + 1000))
            sequence += 1
    return events


def test_synchronized_batch_normalization_that_is_not_hidden_is_named():
    moments = [(Collective.BATCHNORM_MOMENTS, 2, 4)]
    report = timeline_report.step_report([_rank_events(8, moments), _rank_events(8, moments)], [0, 0], ["a", "b"])
    assert "fewer synchronized BatchNormalization layers" in report
    assert "Straggler" not in report


def test_many_small_buckets_ask_for_a_higher_fusion_threshold():
    blocked = [(Collective.GRADIENTS, 5, 8)]
    by_rank = [_rank_events(8, blocked, buckets=[40_000] * 12) for _ in range(2)]
    assert "a higher fusion threshold" in timeline_report.step_report(by_rank, [0, 0], ["a", "b"], 32 * 1024)


def test_a_rank_that_computes_longer_is_named_as_a_slow_host():
    by_rank = [_rank_events(8), _rank_events(8, slow_compute=6)]
    # Rank 0 waits at the step's last collective for rank 1, which arrives 6 ms later.
    for rank, arrival in ((0, 3), (1, 9)):
        for k in range(8):
            start = k * 20 * MS
            metrics = Collective.LOSSES_AND_METRICS
            by_rank[rank].append(("blocked", timeline_report.OPS_ROW, metrics.name, metrics.what,
                                  start + arrival * MS, start + 9 * MS + MS // 10))
            by_rank[rank].append(("collective", k, metrics.name, metrics.what, start + arrival * MS,
                                  start + 9 * MS + MS // 10))
    report = timeline_report.step_report(by_rank, [0, 0], ["fast", "busy"])
    assert "Straggler: rank 1 (host busy)" in report
    assert "a slow host: rank 1" in report


def test_projection_from_a_multi_rank_trace_reads_each_buckets_ready_time_and_bytes(tmp_path):
    step = {"pid": 0, "cat": "step", "name": "train step", "ph": "X"}
    events = [dict(step, ts=1_000_000, dur=300_000), dict(step, ts=2_000_000, dur=320_000)]
    for start in (1_000_000, 2_000_000):
        events += [{"pid": 0, "name": "hand-over of bucket 0", "ph": "i", "ts": start + 100_000},
                   {"pid": 0, "name": "hand-over of bucket 1", "ph": "i", "ts": start + 250_000}]
    events += [{"pid": 0, "cat": "gradients", "ph": "X", "name": "allreduce", "ts": 0, "dur": 1,
                "args": {"bucket": b, "bytes": n}} for b, n in ((0, 4_000_000), (1, 1_000_000))]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    compute, buckets = timeline_projection.schedule_from_trace(str(trace))
    assert compute == pytest.approx(0.25)
    assert buckets == [(pytest.approx(0.1), 4_000_000), (pytest.approx(0.25), 1_000_000)]
    # 2 ranks, no latency, 1 GB/s: the ring moves 2 (p-1)/p s bytes: 4 ms and 1 ms; bucket 0 ends at
    # 104 ms, bucket 1 at 251 ms: the step is 251 ms, efficiency 0.25 / 0.251.
    result = timeline_projection.project(compute, lambda p: buckets, [2], 0.0, 1e9)
    assert result[2]["tarantella"][0] == pytest.approx(0.251)
    assert result[2]["tarantella"][1] == pytest.approx(0.25 / 0.251)
    # One bucket after backprop: 250 ms + 5 ms.
    assert result[2]["one bucket"][0] == pytest.approx(0.255)


def test_the_projection_costs_buckets_with_the_reducers_own_ring_cut_over():
    from tarantella.runtime import reducer
    assert timeline_projection.RING_MIN_BYTES == reducer._RING_MIN_BYTES


def _timeline_command(*args):
    script = pathlib.Path(sys.executable).with_name("tarantella-timeline")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "tarantella.timeline_picture"]
    return subprocess.run(command + [str(a) for a in args], capture_output=True, text=True, env=quiet_env(),
                          timeout=120)


def test_a_traced_step_is_projected_to_many_ranks_from_its_own_buckets(steady_run, tmp_path):
    _, trace, facts = steady_run
    traced_path = tmp_path / "trace.json"
    traced_path.write_text(json.dumps(trace))
    per_step = len([b for b in _slices(trace, 0, "bucket ")]) // facts["fit_steps"]
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    for link, path in (((0, 1e6), fast), ((50, 0.001), slow)):
        process = _timeline_command(traced_path, "--project", "--ranks", "2,16,256", "--latency-us", link[0],
                                    "--gbit", link[1], "--json", path)
        assert_ok(process)
        assert "tarantella step ms" in process.stdout
    fast, slow = json.loads(fast.read_text()), json.loads(slow.read_text())
    for projected in (fast, slow):
        for p in ("2", "16", "256"):  # the master's buckets of one step, as the trace has them
            assert len(projected["buckets"][p]) == per_step
            assert sum(nbytes for _, nbytes in projected["buckets"][p]) == facts["gradient_bytes"]
    # A free network costs nothing; on a slow one (1 Mb/s, 50 us) more ranks cost more.
    assert all(fast["projection"][p]["tarantella"][1] == pytest.approx(1.0) for p in ("2", "16", "256"))
    efficiency = [slow["projection"][p]["tarantella"][1] for p in ("2", "16", "256")]
    assert 1.0 > efficiency[0] > efficiency[1] > efficiency[2] > 0


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-rank")
    process = run_python(WORKERS / "timeline.py", "steady", folder, env={"TNT_TIMELINE": str(folder / "t.json")},
                         timeout=300)
    assert_ok(process)
    return process, folder


def test_a_one_rank_trace_is_projected_with_the_saved_model_and_the_automatic_threshold(one_rank_run, tmp_path):
    _, folder = one_rank_run
    refused = _timeline_command(folder / "t.json", "--project", "--latency-us", "2", "--gbit", "100")
    assert refused.returncode == 2 and "is a 1-rank trace, which holds no gradient buckets: add --model-file" in \
        refused.stderr
    import keras
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024), keras.layers.Dense(1024),
                              keras.layers.Dense(10)])
    model.save(tmp_path / "model.keras")
    projected = tmp_path / "projected.json"
    assert_ok(_timeline_command(folder / "t.json", "--project", "--latency-us", "2", "--gbit", "100",
                                "--model-file", tmp_path / "model.keras", "--ranks", "2,32", "--json", projected))
    buckets = json.loads(projected.read_text())["buckets"]
    weights = sum(w.size for w in model.get_weights()) * 4
    # One rank per node: a 1 MiB threshold at 2 ranks (the 4 MiB kernel alone, the rest fused), 16 MiB
    # at 32 (all in one bucket).
    assert all(sum(n for _, n in buckets[p]) == weights for p in ("2", "32"))
    assert [n for _, n in buckets["2"]] == [1024 * 1024 * 4, weights - 1024 * 1024 * 4]
    assert len(buckets["32"]) == 1


def test_one_process_without_the_launcher_writes_a_trace_of_one_rank(one_rank_run):
    process, folder = one_rank_run
    trace = json.loads((folder / "t.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert len(_slices(trace, 0, "training step")) == json.loads((folder / "facts.json").read_text())["fit_steps"]
    assert "tarantella timeline:" in process.stdout and "Straggler" not in process.stdout
