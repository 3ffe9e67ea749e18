"""What automatic backups (`tarantella --max-restarts`) and checkpoints cost on examples/resnet50.py.

Runs the example on 2 ranks once per variant, the variants one after another, and all of that
`--rounds` times (the second round in reverse order, and so on), so that a ratio to the run
without backups comes from runs made minutes apart:
- no backups (the example's ModelCheckpoint writes after each epoch, as in every variant that
  does not replace it);
- automatic backups at every epoch's end, and also every `--every-steps` steps;
- ModelCheckpoint every `--every-steps` steps, written in place while training waits;
- the same, written in the background (`write_in_background=True`).
Each run trains `--epochs` epochs of `--samples / --batch-size` steps on synthetic 32x32 images.
The table gives, per variant, the files written, their size, the seconds the step waits for
one (a backup: the master snapshots the state in host memory; a checkpoint in the background:
the same for the host copy of the model that a thread writes from, built at the first checkpoint,
or for a subclassed model Keras' write into the temporary folder; in place: the whole write), the
seconds a thread then takes to write it while training goes on, the training time per step from
Keras' epoch lines, and, per round, the step time over that round's run without backups. Below
it: how long the step waited for the file before (one is in flight at a time), and how long the
host copy took to build.

    python benchmarks/backups.py                    # 2 epochs of 100 steps, 2 rounds
    python benchmarks/backups.py --samples 320 --epochs 1 --every-steps 5 --rounds 1   # a quick check
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("none", "backups", "checkpoint", "checkpoint-background")
_BACKUP_LINE = re.compile(r"backup of fit #\d+ at epoch \d+, step \d+: ([\d.]+) MB snapshot in ([\d.]+) s after "
                          r"waiting ([\d.]+) s for the previous backup, written in ([\d.]+) s")
_IN_PLACE_LINE = re.compile(r"checkpoint\.weights\.h5 written in place in ([\d.]+) s")
_STEP_WAITED_LINE = re.compile(r"checkpoint\.weights\.h5: the step waited ([\d.]+) s")
_HOST_COPY_LINE = re.compile(r"host copy of \S+ for checkpoints built in ([\d.]+) s")
_THREAD_LINE = re.compile(r"checkpoint\.weights\.h5: written into place by a thread in ([\d.]+) s")
# Keras' epoch line, verbose=2: "100/100 - 52s - 517ms/step - loss: ..." (or "1s/step")
_EPOCH_LINE = re.compile(r"^\d+/\d+ - (\d+)s(?: -)? (\d+)(ms|s)/step", re.M)


def names(options):
    return {"none": "no backups", "backups": f"backups every epoch and every {options.every_steps} steps",
            "checkpoint": f"ModelCheckpoint every {options.every_steps} steps, in place",
            "checkpoint-background": f"ModelCheckpoint every {options.every_steps} steps, in the background"}


def run(variant, options, folder):
    command = [sys.executable, "-m", "tarantella.launcher", "-n", str(options.ranks), "--no-gpu", "--log-level", "DEBUG"]
    if variant == "backups":
        command += ["--max-restarts", "0", "--backup-dir", str(folder / "backups"),
                    "--backup-every-steps", str(options.every_steps)]
    command += ["--", str(REPOSITORY / "examples" / "resnet50.py"), "--samples", str(options.samples),
                "--batch-size", str(options.batch_size), "--epochs", str(options.epochs),
                "--output-dir", str(folder / "output")]
    if variant.startswith("checkpoint"):
        command += ["--checkpoint-every-steps", str(options.every_steps)]
    if variant == "checkpoint-background":
        command += ["--checkpoint-in-background"]
    started = time.monotonic()
    process = subprocess.run(command, capture_output=True, text=True, cwd=folder,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore",
                                      TMPDIR=str(folder)))
    wall = time.monotonic() - started
    if process.returncode:
        sys.exit(f"{variant}: exit {process.returncode}\n{process.stderr[-4000:]}")
    log = process.stderr
    if variant == "backups":
        backups = [tuple(map(float, numbers)) for numbers in _BACKUP_LINE.findall(log)]
        files = {"megabytes": backups[0][0], "waits": [b[1] for b in backups], "queued": [b[2] for b in backups],
                 "writes": [b[3] for b in backups]}
    elif variant.startswith("checkpoint"):
        in_background = variant == "checkpoint-background"
        waits = [float(s) for s in (_STEP_WAITED_LINE if in_background else _IN_PLACE_LINE).findall(log)]
        writes = [float(s) for s in _THREAD_LINE.findall(log)] if in_background else []
        size = (folder / "output" / "checkpoint.weights.h5").stat().st_size / 1e6
        files = {"megabytes": size, "waits": waits, "writes": writes,
                 "host_copy": [float(s) for s in _HOST_COPY_LINE.findall(log)]}
    else:
        files = None
    step_ms = [int(step) * (1 if unit == "ms" else 1000) for _, step, unit in _EPOCH_LINE.findall(process.stdout)]
    if not step_ms:
        sys.exit(f"{variant}: no epoch line with a step time in the example's output:\n{process.stdout[-2000:]}")
    return {"files": files, "step_ms": statistics.mean(step_ms), "wall_s": wall}


def seconds(values):
    return f"{statistics.median(values):.3f}, {max(values):.3f}" if values else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3200, help="synthetic training images (steps = samples / batch)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every variant, interleaved")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all; 'none' is always run)")
    options = parser.parse_args()
    named = options.variants.split(",")
    unknown = [variant for variant in named if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    chosen = [variant for variant in VARIANTS if variant in named or variant == "none"]
    results = {variant: [] for variant in chosen}
    for round_number in range(options.rounds):
        for variant in chosen if round_number % 2 == 0 else chosen[::-1]:
            with tempfile.TemporaryDirectory(prefix=f"tnt-backup-bench-{variant}-") as folder:
                results[variant].append(run(variant, options, pathlib.Path(folder)))
            print(f"round {round_number + 1}, {variant}: {results[variant][-1]['step_ms']:.0f} ms/step",
                  file=sys.stderr, flush=True)
    steps = -(-options.samples // options.batch_size)
    print(f"ResNet-50, {options.ranks} ranks, {options.epochs} epoch(s) of {steps} steps, global batch "
          f"{options.batch_size}, 32x32 images, {options.rounds} round(s)")
    print("| variant | files written per run | MB each | s the step waits per file (median, max) | s a thread writes "
          "(median, max) | ms per step, per round | step vs. no backups, per round |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        files = [run["files"] for run in runs if run["files"]]
        step = ", ".join(f"{run['step_ms']:.0f}" for run in runs)
        ratios = ", ".join(f"{100 * (run['step_ms'] / none['step_ms'] - 1):+.1f}%"
                           for run, none in zip(runs, results["none"])) if variant != "none" else ""
        if files:
            cells = (f"{len(files[0]['waits'])}", f"{files[0]['megabytes']:.0f}",
                     seconds([s for f in files for s in f["waits"]]), seconds([s for f in files for s in f["writes"]]))
        else:
            cells = ("-", "-", "-", "-")
        print(f"| {names(options)[variant]} | " + " | ".join(cells) + f" | {step} | {ratios} |")
    for variant, runs in results.items():
        files = [run["files"] for run in runs if run["files"]]
        queued = [s for f in files for s in f.get("queued", [])]
        built = [s for f in files for s in f.get("host_copy", [])]
        if queued:
            print(f"{names(options)[variant]}: the step waited for the backup before at most {max(queued):.3f} s "
                  f"(median {statistics.median(queued):.3f} s)")
        if built:
            print(f"{names(options)[variant]}: the host copy was built in {seconds(built)} s (median, max; "
                  "included in its first file's wait)")


if __name__ == "__main__":
    main()
