import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


def launcher_command():
    """The installed `tarantella` command, as a user runs it."""
    script = pathlib.Path(sys.executable).with_name("tarantella")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tarantella.launcher"]


def quiet_env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def launch(ranks, script, *args, options=(), env=None, timeout=600):
    """Runs `tarantella -n RANKS [options] -- script args` and returns the finished process."""
    command = launcher_command() + ["-n", str(ranks), *options, "--", str(script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=quiet_env(**(env or {})))


def run_python(script, *args, env=None, timeout=600):
    """Runs a script with plain `python`, no launcher."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=quiet_env(**(env or {})))


def load_npz(path):
    """A worker's saved results as a dict of arrays."""
    with np.load(path) as stored:
        return {key: stored[key] for key in stored.files}


def assert_ok(process):
    assert process.returncode == 0, f"exit {process.returncode}\nstdout:\n{process.stdout}\nstderr:\n{process.stderr}"


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def assert_ranks_like_serial(serial_dir, out, cases, ranks, backend="", weights_rtol=0.0):
    """Each rank's saved results (CASE.rankR.npz in `out`) against the serial run's (in
    `serial_dir`), at the equivalence matrix's tolerances: weights within 1e-5 (plus `weights_rtol`
    of their size) and identical on every rank; predictions, History and evaluate within 1e-5
    relative."""
    for case in cases:
        serial = load_npz(serial_dir / f"{case}.rank0.npz")
        per_rank = [load_npz(out / f"{case}.rank{rank}.npz") for rank in range(ranks)]
        for rank, result in enumerate(per_rank):
            assert sorted(result) == sorted(serial), case
            for key in serial:
                context = f"{backend}{', ' if backend else ''}case {case}, rank {rank} of {ranks}, {key}"
                if key.startswith("weight_"):
                    np.testing.assert_allclose(result[key], serial[key], rtol=weights_rtol, atol=1e-5, err_msg=context)
                    np.testing.assert_array_equal(result[key], per_rank[0][key], err_msg=context + " vs rank 0")
                elif key == "predictions":  # every prediction, in sample order, on every rank
                    np.testing.assert_allclose(result[key], serial[key], rtol=1e-5, atol=1e-6, err_msg=context)
                else:  # History, evaluate
                    np.testing.assert_allclose(result[key], serial[key], rtol=1e-5, atol=1e-7, err_msg=context)


def assert_accumulation_sums_once_per_cycle(serial_dir, out, ranks):
    """The case mlp-accumulation of tests/workers/train_cases.py (gradient_accumulation_steps=k): each
    rank collected one gradient round per k micro-steps (none on 1 rank, which sums nothing), and the
    master's accumulators after fit, in the middle of a cycle, are serial Keras' own."""
    from workers.train_cases import ACCUMULATION_STEPS, CASES, SAMPLES
    case = "mlp-accumulation"
    micro_steps = 2 * -(-SAMPLES // CASES[case][2])  # two epochs
    expected = 0 if ranks == 1 else micro_steps // ACCUMULATION_STEPS
    for rank in range(ranks):
        assert (out / f"{case}.rank{rank}.rounds").read_text() == str(expected), f"rank {rank} of {ranks}"
    serial = load_npz(serial_dir / f"{case}.accumulators.npz")
    master = load_npz(out / f"{case}.accumulators.npz")
    assert any(np.abs(value).max() > 0 for value in serial.values()), "the fit should end inside a cycle"
    for key in serial:
        np.testing.assert_allclose(master[key], serial[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{case}, accumulator {key}, {ranks} ranks")


def assert_saved_synchronized_model_trains_on_like_serial(backend, ranks, folder, weights_rtol=0.0):
    """A file that tnt.Model.save wrote on `ranks` ranks from a model with synchronized
    BatchNormalization loads with keras.models.load_model on every rank and in a process without
    tarantella, and, trained on for an epoch there and under
    tnt.models.load_model(..., synchronized_batch_normalization=True) on the ranks, ends as serial
    Keras' own file does (tests/workers/synchronized_batch_norm.py, case sync-bn-saved)."""
    worker, case, env = WORKERS / "synchronized_batch_norm.py", "sync-bn-saved", {"KERAS_BACKEND": backend}
    serial, ranks_dir, read_serially = folder / "serial", folder / "ranks", folder / "read-serially"
    for out in (serial, ranks_dir, read_serially):
        out.mkdir()
    arguments = (worker, "--mode", "tnt", "--out", ranks_dir, "--cases", case)
    assert_ok(run_python(*arguments, env=env) if ranks == 1 else launch(ranks, *arguments, env=env))
    assert_ok(run_python(worker, "--mode", "serial", "--out", serial, "--cases", case,
                         "--train-on-saved", ranks_dir / f"{case}.keras", read_serially, env=env))
    assert_ranks_like_serial(serial, ranks_dir, [case], ranks, backend, weights_rtol)
    assert_ranks_like_serial(serial, read_serially, [case], 1, backend, weights_rtol)


def refusals_by_rank(stdout):
    """{rank: message} of the lines "rank R refused: ..." that ranks print; the ranks' lines may
    arrive interleaved, so each is read up to the next one."""
    return {int(rank): text for rank, text in re.findall(r"rank (\d+) refused: (.*?)(?=rank \d+ refused|\n|$)", stdout)}


def cores_seen(process, ranks):
    """What each rank of a job of tests/workers/cores_seen.py printed: {rank: (its cores, whether
    every thread of it runs on them, TensorFlow's intra-op threads)}."""
    assert_ok(process)
    found = re.findall(r"rank (\d) cores \[([\d, ]*)\] all threads (\w+) tensorflow threads (\d+)", process.stdout)
    assert sorted(int(rank) for rank, *_ in found) == list(range(ranks)), process.stdout[-2000:]
    return {int(rank): ([int(core) for core in cores.split(", ")], every == "True", int(threads))
            for rank, cores, every, threads in found}


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a file system of one page, nearly full."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
