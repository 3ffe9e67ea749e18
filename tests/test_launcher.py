"""The `tarantella` command: the command it builds, and what ranks see when it runs."""

import re
import subprocess
import sys

from conftest import WORKERS, assert_ok, launch, launcher_command, quiet_env, run_python

SCENARIOS = WORKERS / "scenarios.py"


def dry_run(*arguments):
    process = subprocess.run(launcher_command() + ["--dry-run", *arguments], capture_output=True,
                             text=True, timeout=60)
    assert_ok(process)
    return process.stdout


def test_dry_run_shows_the_exact_command_and_environment_in_order():
    output = dry_run("-n", "3", "-x", "B=2", "A=has space", "-x", "C=x=y", "--fusion-threshold", "8",
                     "--output-on-all-devices", "--", "train.py", "--epochs", "2")
    command = output.splitlines()[1]
    assert " -n 3 " in command
    assert re.search(r"/python[\d.]* train\.py --epochs 2$", command), command
    assert "-genv TNT_FUSION_THRESHOLD 8" in command and "-genv A 'has space'" in command
    environment = [line.strip() for line in output.split("environment")[1].splitlines()[1:]]
    assert environment == ["PYTHONUNBUFFERED=1", "TNT_FUSION_THRESHOLD=8", "TNT_OUTPUT_ON_ALL_DEVICES=true",
                           "B=2", "A=has space", "C=x=y"]


def test_a_program_that_is_not_python_runs_as_it_is():
    assert dry_run("-n", "2", "--", "hostname").splitlines()[1].endswith(" -n 2 -genv PYTHONUNBUFFERED 1 hostname")


def test_malformed_options_are_refused():
    for arguments, message in [(["-x", "NOVALUE", "--", "t.py"], "-x expects VAR=VALUE, got 'NOVALUE'"),
                               (["-n", "0", "--", "t.py"], "expects a whole number of ranks >= 1"),
                               (["-n", "2"], "name the program after '--'")]:
        process = subprocess.run(launcher_command() + arguments, capture_output=True, text=True, timeout=60)
        assert process.returncode == 2 and message in process.stderr


def test_ranks_see_their_rank_size_and_the_x_variables():
    process = launch(3, SCENARIOS, "identity", "GREETING", "EMPTY",
                     options=["-x", "GREETING=hello world", "EMPTY="], timeout=120)
    assert_ok(process)
    for rank in range(3):
        assert f"rank {rank}: size 3 master 0 is_master {rank == 0}" in process.stdout
        assert f"rank {rank}: GREETING=hello world" in process.stdout
        assert f"rank {rank}: EMPTY=" in process.stdout


def test_keras_output_appears_once_unless_asked_for_every_rank():
    process = launch(2, SCENARIOS, "keras-output", timeout=300)
    assert_ok(process)
    assert process.stdout.count("Total params: 48") == 1
    assert process.stdout.count("Epoch 2/2") == 1
    assert "plain print from rank 0" in process.stdout and "plain print from rank 1" in process.stdout
    everywhere = launch(2, SCENARIOS, "keras-output", options=["--output-on-all-devices"], timeout=300)
    assert_ok(everywhere)
    assert everywhere.stdout.count("Total params: 48") == 2
    assert everywhere.stdout.count("Epoch 2/2") == 2


def test_plain_python_runs_one_rank_and_mpiexec_runs_several():
    serial = run_python(SCENARIOS, "identity", timeout=120)
    assert_ok(serial)
    assert "rank 0: size 1 master 0 is_master True" in serial.stdout
    mpiexec = str(launcher_command()[0]).rsplit("/", 1)[0] + "/mpiexec"
    direct = subprocess.run([mpiexec, "-n", "2", sys.executable, str(SCENARIOS), "identity"],
                            capture_output=True, text=True, timeout=120, env=quiet_env())
    assert_ok(direct)
    assert "rank 1: size 2 master 0 is_master False" in direct.stdout
