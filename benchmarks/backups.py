"""What automatic backups (`tarantella --max-restarts`) cost on examples/resnet50.py.

Runs the example on 2 ranks three times, one after another: without backups, backing up at
every epoch's end, and also every 50 steps. Each run trains `--epochs` epochs of
`--samples / --batch-size` steps on synthetic 32x32 images. The table gives, per variant, the
backups written (fit's final state included), their size, the seconds the step waits for one (the
master copies the state to host memory) and the seconds its writing takes (a thread of the
master's, while training goes on), and the training time per step and per epoch, from Keras' own
epoch lines, with its difference to the run without backups.

    python benchmarks/backups.py                    # 2 epochs of 100 steps
    python benchmarks/backups.py --samples 320 --epochs 1 --every-steps 5   # a quick check

Runs made one after another on a shared machine differ by tens of percent; the seconds per
backup, measured around the copy and the write themselves, are the steadier numbers.
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
_BACKUP_LINE = re.compile(r"backup of fit #\d+ at epoch \d+, step \d+: ([\d.]+) MB copied in ([\d.]+) s, written in "
                          r"([\d.]+) s")
_EPOCH_LINE = re.compile(r"^\d+/\d+ - (\d+)s (\d+)ms/step", re.M)


def run(variant, options, folder):
    command = [sys.executable, "-m", "tarantella.launcher", "-n", str(options.ranks), "--no-gpu", "--log-level", "DEBUG"]
    if variant != "none":
        command += ["--max-restarts", "0", "--backup-dir", str(folder / "backups")]
    if variant == "steps":
        command += ["--backup-every-steps", str(options.every_steps)]
    command += ["--", str(REPOSITORY / "examples" / "resnet50.py"), "--samples", str(options.samples),
                "--batch-size", str(options.batch_size), "--epochs", str(options.epochs),
                "--output-dir", str(folder / "output")]
    started = time.monotonic()
    process = subprocess.run(command, capture_output=True, text=True, cwd=folder,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore"))
    wall = time.monotonic() - started
    if process.returncode:
        sys.exit(f"{variant}: exit {process.returncode}\n{process.stderr[-4000:]}")
    backups = [tuple(map(float, numbers)) for numbers in _BACKUP_LINE.findall(process.stderr)]
    epochs = [(int(seconds), int(step_ms)) for seconds, step_ms in _EPOCH_LINE.findall(process.stdout)]
    return {"backups": backups, "epoch_s": statistics.mean(s for s, _ in epochs) if epochs else float("nan"),
            "step_ms": statistics.mean(ms for _, ms in epochs) if epochs else float("nan"), "wall_s": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3200, help="synthetic training images (steps = samples / batch)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=50)
    options = parser.parse_args()
    results = {}
    for variant in ("none", "epoch", "steps"):
        with tempfile.TemporaryDirectory(prefix=f"tnt-backup-bench-{variant}-") as folder:
            results[variant] = run(variant, options, pathlib.Path(folder))
        print(f"{variant}: done", file=sys.stderr, flush=True)
    steps = -(-options.samples // options.batch_size)
    names = {"none": "no backups", "epoch": "every epoch", "steps": f"every epoch and every {options.every_steps} steps"}
    print(f"ResNet-50, {options.ranks} ranks, {options.epochs} epoch(s) of {steps} steps, global batch "
          f"{options.batch_size}, 32x32 images")
    print("| backups | written | MB each | s the step waits, copying (median, max) | s writing, in a thread (median, "
          "max) | ms per step | s per epoch | step vs. no backups |")
    print("|---|---|---|---|---|---|---|---|")
    baseline = results["none"]["step_ms"]
    for variant, result in results.items():
        backups = result["backups"]
        if backups:
            copied, written = [b[1] for b in backups], [b[2] for b in backups]
            cells = (f"{len(backups)}", f"{backups[0][0]:.0f}", f"{statistics.median(copied):.3f}, {max(copied):.3f}",
                     f"{statistics.median(written):.3f}, {max(written):.3f}", f"{result['step_ms']:.0f}",
                     f"{result['epoch_s']:.0f}", f"{100 * (result['step_ms'] / baseline - 1):+.1f}%")
        else:
            cells = ("0", "-", "-", "-", f"{result['step_ms']:.0f}", f"{result['epoch_s']:.0f}", "")
        print(f"| {names[variant]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
