"""Bad input raises a clear error on every rank; a failing rank ends the whole job quickly."""

import os
import re
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from conftest import WORKERS, assert_ok, launch, launcher_command, quiet_env

SCENARIOS = WORKERS / "scenarios.py"


def test_each_bad_input_gets_the_same_clear_error_on_every_rank():
    process = launch(2, SCENARIOS, "bad-inputs", timeout=300)
    assert_ok(process)
    expected = {
        "fit before compile": "RuntimeError: Call model.compile",
        "Ftrl": "ValueError: tnt.Model does not support the Ftrl optimizer",
        "unknown gradient wire": "ValueError: tnt.Model(gradient_wire=...): 'fp16' is not a gradient wire: use "
                                 "'bfloat16' or 'float16'",
        "generator input": "TypeError: tnt.Model.fit takes a tf.data.Dataset, arrays (NumPy or tensors",
        "numpy with a wrong micro-batch": "ValueError: batch_size=5 is the global batch, but "
                                          "tnt_micro_batch_size=4 x 2 ranks = 8",
        "batch_size with dataset": "ValueError: tnt.Model.fit: batch_size=16 cannot be combined",
        "unbatched dataset": "ValueError: The dataset is not batched",
    }
    for rank in (0, 1):
        for case, message in expected.items():
            assert f"rank {rank}: {case}: {message}" in process.stdout, process.stdout
    losses = {line.split()[-1] for line in process.stdout.splitlines() if "loss after errors" in line}
    assert len(losses) == 1, "both ranks trained together after the errors"


@pytest.mark.parametrize("scenario, status, how", [
    ("raise-on-rank-1", 1, "rank 1 on host {host} raised RuntimeError"),
    ("kill-rank-1-mid-epoch", 9, r"rank 1 on host {host} \(pid \d+\) ended: Killed \(signal 9\)"),
    ("exit-3-on-rank-1", 3, "rank 1 on host {host} exited with status 3"),
    # MPI kills rank 0 first while rank 1 waits in MPI_Abort, and may drop MPI's message: rank 0 was named.
    ("mpi-abort-on-rank-1", 3, r"rank 1 on host {host} \(pid \d+\) called MPI_Abort with status 3"),
    # Status 0 in the middle of training is a rank lost, not a success.
    ("exit-0-on-rank-1", 1, r"rank 0 on host {host} raised RankLeftError: rank 1 on host {host} left early: it "
                            r"finished the program after collective #\d+ \(the allreduce of losses and metrics\) "
                            r"while rank 0 waited for it in the gradient allreduce of step \d+ \(in fit\) "
                            r"\(#\d+\)"),
    ("os-exit-0-on-rank-1", 1, r"rank 1 on host {host} left early: it ended with status 0 without finishing the "
                               r"program \(e.g. os._exit\), and the MPI launcher stopped the other ranks. .*"),
    # A stopped rank: the one that waited names it, once, after a stall warning, within the timeout.
    ("stop-rank-1", 1, r"rank 0 on host {host} raised CollectiveTimeoutError: rank\(s\) 1 did not arrive at the "
                       r"gradient allreduce of step \d+ \(in fit\) within 4 s \(rank 1 did not "
                       r"answer \(stopped, or stuck outside Python\); it took part in collective #\d+ \(the "
                       r"allreduce of losses and metrics\)\)"),
])
def test_a_failing_rank_stops_the_whole_job_within_10_s_naming_rank_and_host(scenario, status, how):
    process = launch(2, SCENARIOS, scenario, options=["-x", "TNT_COLLECTIVE_TIMEOUT=4", "TNT_STALL_WARNING=1"],
                     timeout=120)
    ended = time.time()
    failed_at = float(re.search(r"rank 1: failing at ([\d.]+)", process.stderr).group(1))
    assert process.returncode == status, process.stderr
    last_line = process.stderr.strip().splitlines()[-1]
    assert re.fullmatch(f"tarantella: the job failed \\(exit status {status}\\): "
                        + how.format(host=re.escape(socket.gethostname())) + r"\.", last_line), last_line
    assert ended - failed_at < 10, f"the job ended {ended - failed_at:.1f} s after rank 1 failed"
    assert "UnknownError" not in process.stderr, process.stderr  # TensorFlow's wrapper is not shown
    if scenario == "stop-rank-1":
        assert process.stderr.count("did not complete within 4 s") == 1, process.stderr
        assert re.search(r"tarantella: WARNING: rank 0 has waited 1 s in the gradient allreduce of step \d+ "
                         r"\(in fit\) \(collective #\d+\) for 1 rank\(s\): rank 1 did not answer",
                         process.stderr)


def test_ctrl_c_stops_every_rank_and_leaves_no_process_behind():
    command = launcher_command() + ["-n", "2", "--", str(SCENARIOS), "train-until-interrupted"]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=quiet_env(), start_new_session=True)
    try:
        training = set()
        for line in launcher.stderr:  # both ranks are in the training loop once both said so
            if line.endswith(": training\n"):
                training.add(line.split(":")[0])
                if len(training) == 2:
                    break
        interrupted = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 128 + signal.SIGINT
        assert time.monotonic() - interrupted < 10
        time.sleep(0.5)
        assert _processes_naming("train-until-interrupted") == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def _processes_naming(word):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command_line = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in command_line:
            found.append(f"{pid}: {command_line}")
    return found


def test_ranks_with_different_models_fail_at_the_first_broadcast_naming_the_difference():
    process = launch(2, SCENARIOS, "different-models", timeout=120)
    assert process.returncode != 0
    assert "The model differs between ranks (ranks [1] differ from the master): variable #0 is ((6, 5)" \
        in process.stderr


def test_ranks_with_different_optimizers_fail_at_the_first_broadcast_naming_the_difference():
    process = launch(2, SCENARIOS, "different-optimizers", timeout=120)
    assert process.returncode == 1
    assert ("ValueError: The compiled training step differs between ranks (ranks [1] differ from the master): "
            "compile['optimizer']['class_name'] is 'RMSprop' on rank 1 but 'SGD' on the master.") in process.stderr


def test_ranks_with_different_gradient_wires_fail_at_the_first_broadcast_naming_both():
    process = launch(2, SCENARIOS, "different-wires", timeout=120)
    assert process.returncode == 1
    assert ("ValueError: The gradient wire differs between ranks (ranks [1] differ from the master): the gradients "
            "would travel as float32 on rank 1 but as bfloat16 on the master.") in process.stderr


def test_ranks_given_different_hierarchical_allreduce_settings_fail_at_start_naming_each(tmp_path):
    script = tmp_path / "differing_settings.py"
    script.write_text("import os\n"
                      "os.environ['TNT_HIERARCHICAL_ALLREDUCE'] = 'on' if os.environ['PMI_RANK'] == '0' else 'off'\n"
                      "import tarantella\n")
    process = launch(2, script, timeout=120)
    assert process.returncode == 1
    assert ("ValueError: TNT_HIERARCHICAL_ALLREDUCE differs between ranks (rank 0: on, rank 1: off); give every "
            "rank the same") in process.stderr


def test_a_save_called_on_the_master_only_fails_at_once_saying_to_call_it_everywhere(tmp_path):
    started = time.monotonic()
    target = tmp_path / "model.keras"
    process = launch(2, SCENARIOS, "master-only-save", target, options=["-x", "TNT_COLLECTIVE_TIMEOUT=60"],
                     timeout=120)
    assert process.returncode == 1
    assert re.search(r"raised RankLeftError: rank 1 on host \S+ left early: it finished the program after "
                     rf"collective #\d+ \(.*\) while rank 0 waited for it in the save of {re.escape(str(target))} "
                     r"\(in save\) \(#\d+\)\.$", process.stderr.strip().splitlines()[-1]), process.stderr
    assert "call save on every rank; tarantella writes on the master only." in process.stderr
    assert time.monotonic() - started < 50, "it did not wait for the collective timeout"
    assert target.stat().st_size > 0  # the master wrote the file before it needed the others


def test_saves_clean_abandoned_partial_files_agree_on_overwrite_and_name_the_target(tmp_path):
    process = launch(2, SCENARIOS, "saves", tmp_path, timeout=120)
    assert_ok(process)
    assert "rank 0: abandoned partial file left: False" in process.stdout, process.stdout
    for rank in (0, 1):
        assert f"rank {rank}: overwrite=False on new files: ['saved']" in process.stdout, process.stdout
        missing = re.search(rf"rank {rank}: save into a missing folder: (.*)", process.stdout).group(1)
        assert str(tmp_path / "missing" / "m.keras") in missing and ".tnt-partial" not in missing, missing


def test_a_rank_left_waiting_in_evaluate_learns_at_once_that_the_other_finished():
    started = time.monotonic()
    process = launch(2, SCENARIOS, "uneven-steps", timeout=120)  # no short timeout needed
    assert process.returncode == 1
    assert re.search(r"rank 1 on host \S+ raised RankLeftError: rank 0 on host \S+ left early: it finished the "
                     r"program after collective #\d+ \(.*\) while rank 1 waited for it in .* \(in evaluate\)",
                     process.stderr.strip().splitlines()[-1]), process.stderr
    assert time.monotonic() - started < 60


def test_ranks_in_different_collectives_get_an_error_naming_both_operations():
    process = launch(2, SCENARIOS, "evaluate-while-fit", timeout=120)
    assert process.returncode == 1
    # Each step opens with an agreement on its kind and its collectives: the first one tells (a
    # training step's gradient round, where its loss needs the global batch size only after backprop).
    both = ("the ranks entered different collectives: rank 0: the allreduce of micro-batch sizes of a test "
            "step (in evaluate); rank 1: the gradient allreduce of step 1 (in fit)")
    assert process.stderr.strip().splitlines()[-1].endswith(f"raised CollectiveMismatchError: {both}."), \
        process.stderr
    for rank in (0, 1):
        assert re.search(f"CollectiveMismatchError: rank {rank}: " + re.escape(both).replace(
            ":", r" \(collective #\d+\):", 1), process.stderr), process.stderr
    assert "Message truncated" not in process.stderr


def test_a_fusion_threshold_that_is_not_a_number_is_refused():
    process = launch(2, SCENARIOS, "identity", options=["--fusion-threshold", "big"], timeout=60)
    assert process.returncode == 2
    assert "--fusion-threshold: expects a number of kilobytes >= 0, got 'big'" in process.stderr
    process = launch(2, SCENARIOS, "identity", options=["-x", "TNT_FUSION_THRESHOLD=big"], timeout=120)
    assert process.returncode != 0
    assert "TNT_FUSION_THRESHOLD='big' is not a number of kilobytes" in process.stderr


@pytest.mark.parametrize("kind, failure", [
    ("checkpoint", r"FailingCheckpoint on rank 0 failed: NotADirectoryError: \[Errno 20\] Not a directory: '[^']*'"),
    ("nospace", r"NoSpaceLeft on rank 0 failed: OSError: \[Errno 28\] No space left on device"),
])
def test_a_failing_master_only_callback_fails_every_rank_with_its_error_within_seconds(tmp_path, kind, failure):
    # The checkpoint fails at the end of epoch 2, where rank 1 waits for the master's callbacks;
    # the other in the middle of epoch 2, where rank 1 is in the next step's collectives.
    process = launch(2, SCENARIOS, "master-callback-fails", kind, tmp_path, timeout=120)
    ended = time.time()
    failed_at = float(re.search(r"rank 0: failing at ([\d.]+)", process.stderr).group(1))
    assert process.returncode == 1, process.stderr
    assert ended - failed_at < 5, f"the job ended {ended - failed_at:.1f} s after the master's callback failed"
    assert re.search(f"RankFailedError: rank 1: {failure}. The job stops.", process.stderr), process.stderr
    assert re.search(f"tarantella: rank 1 on host {re.escape(socket.gethostname())} failed with RankFailedError: "
                     f"{failure}; stopping all ranks.", process.stderr), process.stderr
    error = "NotADirectoryError" if kind == "checkpoint" else "OSError"
    assert process.stderr.strip().splitlines()[-1] == \
        f"tarantella: the job failed (exit status 1): rank 0 on host {socket.gethostname()} raised {error}."
    assert "did not complete within" not in process.stderr and "UnknownError" not in process.stderr


HIDDEN_STDERR = textwrap.dedent("""
    import os, sys
    sys.stderr = open(os.devnull, "w")  # a common way to hide TensorFlow's warnings
    import tarantella as tnt
    import keras, numpy as np
    model = tnt.Model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile("sgd", "mse")
    model.fit(np.ones((32, 3), "float32"), np.ones((32, 1), "float32"), batch_size=8, epochs=2, verbose=0)
    if sys.argv[1] == "raise" and tnt.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    sys.stdout.write(f"rank {tnt.get_rank()} trained\\n")
""")


def test_a_program_that_hides_sys_stderr_ends_as_it_really_ended(tmp_path):
    # The ranks' announcements to the command go to the process's standard error itself; once they
    # went through sys.stderr, and a job that trained to the end was reported as "left early".
    script = tmp_path / "hidden_stderr.py"
    script.write_text(HIDDEN_STDERR)
    process = launch(2, script, "train", timeout=180)
    assert process.returncode == 0, process.stderr
    assert "rank 0 trained" in process.stdout and "left early" not in process.stderr, process.stderr
    process = launch(2, script, "raise", timeout=180)
    assert process.returncode != 0
    host = socket.gethostname()
    assert f"tarantella: the job failed (exit status 1): rank 1 on host {host} raised ValueError" in process.stderr, \
        process.stderr
