"""Runs one first-contact script (tests/first_contact/*.py) as a user runs it, and saves its results.

    python tests/workers/first_contact.py SCRIPT serial OUT_DIR
    tarantella -n N -- tests/workers/first_contact.py SCRIPT tnt OUT_DIR

`serial` removes the script's two tarantella lines (`import tarantella as tnt` and
`model = tnt.Model(model)`; in a training loop of its own, `import tarantella as tnt`,
`optimizer = tnt.optimizers.Optimizer(optimizer)` and `train_dataset = tnt.data.distribute(train_dataset)`), each exactly once, each replaced by an empty line so that tracebacks
keep their line numbers) and runs the rest: plain Keras, the script its user started from. `tnt`
runs the script unchanged. Nothing else differs: both run the source as `__main__` with the
script's own `__file__`, `sys.argv` and `sys.path[0]`, as `python SCRIPT` would, on the backend
KERAS_BACKEND names, and this file imports nothing of Keras or tarantella before the script does.

The script leaves `model`, `history`, `score` and `predictions` as module globals; afterwards each
rank (rank 0 in serial mode) saves OUT_DIR/<script>.rank<R>.npz: the weights (weight_<i>),
the History (history_<name>), evaluate's result (evaluate_<i>, or evaluate_<name> for a dict)
and the predictions, their leaves flattened into one array (predictions).
"""

import io
import pathlib
import sys
import tokenize

import numpy as np

TARANTELLA_LINES = ("import tarantella as tnt", "model = tnt.Model(model)")
# A training loop of the user's own (keras-io's "Writing a training loop from scratch") has no
# tnt.Model: its three lines wrap the optimizer and split the training batches.
LOOP_LINES = ("import tarantella as tnt", "optimizer = tnt.optimizers.Optimizer(optimizer)",
              "train_dataset = tnt.data.distribute(train_dataset)")
RESULTS = ("model", "history", "score", "predictions")


def tarantella_lines(source):
    """The lines a script adds to serial Keras: a loop's where it wraps an optimizer, else the two."""
    return LOOP_LINES if LOOP_LINES[1] in [line.strip() for line in source.splitlines()] else TARANTELLA_LINES


def serial_source(source, script):
    """The script without its tarantella lines; nothing of tarantella may be left in it."""
    lines = source.splitlines(keepends=True)
    for wanted in tarantella_lines(source):
        found = [i for i, line in enumerate(lines) if line.strip() == wanted]
        assert len(found) == 1, f"{script}: the line `{wanted}` occurs {len(found)} times, not once"
        lines[found[0]] = "\n"
    serial = "".join(lines)
    left = [token for token in tokenize.generate_tokens(io.StringIO(serial).readline)
            if token.type == tokenize.NAME and token.string in ("tnt", "tarantella")]
    assert not left, f"{script}: the serial script still uses tarantella on line {left[0].start[0]}: " \
                     f"only the lines {tarantella_lines(source)} may differ"
    return serial


def run_as_main(source, script):
    """Executes the source as `python SCRIPT` does; returns its module globals."""
    sys.argv = [str(script)]
    sys.path[0] = str(script.parent)
    namespace = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__}
    exec(compile(source, str(script), "exec"), namespace)
    missing = [name for name in RESULTS if name not in namespace]
    assert not missing, f"{script}: the script left no global {', '.join(missing)}"
    return namespace


def leaves(value):
    """A structure's arrays (dicts by sorted key, as keras.tree flattens them)."""
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in leaves(value[key])]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in leaves(item)]
    return [np.asarray(value)]


def results(namespace):
    arrays = {f"weight_{i}": np.asarray(w) for i, w in enumerate(namespace["model"].get_weights())}
    arrays.update({f"history_{name}": np.asarray(values, dtype=np.float64)
                   for name, values in namespace["history"].history.items()})
    score = namespace["score"]
    if isinstance(score, dict):
        arrays.update({f"evaluate_{name}": np.asarray(value, dtype=np.float64) for name, value in score.items()})
    else:
        arrays.update({f"evaluate_{i}": np.asarray(value, dtype=np.float64)
                       for i, value in enumerate(score if isinstance(score, (list, tuple)) else [score])})
    arrays["predictions"] = np.concatenate([leaf.astype(np.float64).ravel() for leaf in leaves(namespace["predictions"])])
    return arrays


def main(script, mode, out_dir):
    script = pathlib.Path(script).resolve()
    source = script.read_text()
    serial = serial_source(source, script)  # checked in both modes: the pair must be removable
    if mode not in ("serial", "tnt"):
        raise SystemExit(f"mode {mode!r}: choose serial or tnt")
    namespace = run_as_main(serial if mode == "serial" else source, script)
    if mode == "serial":
        assert "tarantella" not in sys.modules, f"{script}: serial Keras imported tarantella"
    rank = sys.modules["tarantella"].get_rank() if mode == "tnt" else 0
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"{script.stem}.rank{rank}.npz", **results(namespace))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
