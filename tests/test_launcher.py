"""The `tarantella` command: the command it builds, and what ranks see when it runs."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, WORKERS, assert_ok, cores_seen, launch, launcher_command, quiet_env, run_python

SCENARIOS = WORKERS / "scenarios.py"
RANK_ENTRY = str(REPO / "tarantella" / "common" / "rank_entry.py")


def clean_env(**extra):
    """This environment without variables the launcher forwards, on a node without GPUs."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("TNT_", "TF_", "KERAS_", "MPI4PY_", "SLURM_")) and name != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def run_launcher(*arguments, env=None):
    return subprocess.run(launcher_command() + list(arguments), capture_output=True, text=True, timeout=60,
                          env=env or clean_env())


def dry_run(*arguments, env=None):
    process = run_launcher("--dry-run", *arguments, env=env)
    assert_ok(process)
    return process.stdout


def command_of(output):
    return output.splitlines()[1].strip()


def environment_of(output):
    lines = output.split("environment (added for every rank, in this order):\n")[1].splitlines()
    return [line.strip() for line in lines if line.startswith("  ")]


def refused(*arguments, env=None):
    process = run_launcher(*arguments, env=env)
    assert process.returncode == 2, process.stdout + process.stderr
    return process.stderr


def fake_tool(directory, name, script):
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_dry_run_shows_the_exact_command_and_environment_in_order():
    output = dry_run("-n", "3", "-x", "B=2", "A=has space", "-x", "C=x=y", "--fusion-threshold", "8",
                     "--output-on-all-devices", "--log-level", "INFO", "--log-on-all-devices", "--",
                     "train.py", "--epochs", "2")
    command = command_of(output)
    assert " -n 3 " in command
    assert re.search(r"/python[\d.]* \S+/tarantella/common/rank_entry\.py train\.py --epochs 2$", command), command
    assert "-genv TNT_FUSION_THRESHOLD 8" in command and "-genv A 'has space'" in command
    assert environment_of(output) == [
        "PYTHONUNBUFFERED=1", "KERAS_BACKEND=tensorflow", "TNT_FUSION_THRESHOLD=8", "TNT_OUTPUT_ON_ALL_DEVICES=true", "TNT_LOG_LEVEL=INFO",
        "TNT_LOG_ON_ALL_DEVICES=true", "TNT_USE_GPU=false", "TNT_ANNOUNCE_RANKS=true",
        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "B=2", "A=has space", "C=x=y"]
    assert output.splitlines()[-1] == "ranks: 3 (3 per node on this node, CPU)"


def test_python_path_and_tnt_tf_keras_mpi4py_variables_reach_every_host_flags_win():
    env = clean_env(PYTHONPATH="/shared/lib", TNT_FUSION_THRESHOLD="64", TF_CPP_MIN_LOG_LEVEL="2",
                    KERAS_HOME="/shared/keras", MPI4PY_LIBMPI="/opt/mpi/libmpi.so", UNRELATED="no")
    environment = environment_of(dry_run("-n", "2", "--fusion-threshold", "8", "-x", "TF_CPP_MIN_LOG_LEVEL=0",
                                         "--", "t.py", env=env))
    # KERAS_BACKEND: `import tarantella` sets it to tensorflow in the launcher too
    assert environment == ["PYTHONUNBUFFERED=1", "KERAS_BACKEND=tensorflow", "KERAS_HOME=/shared/keras", "MPI4PY_LIBMPI=/opt/mpi/libmpi.so",
                           "PYTHONPATH=/shared/lib", "TNT_FUSION_THRESHOLD=8", "TNT_USE_GPU=false",
                           "TNT_ANNOUNCE_RANKS=true", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
                           "TF_CPP_MIN_LOG_LEVEL=0"]


def test_ranks_back_glibcs_large_blocks_with_huge_pages_unless_the_user_chose():
    def tunables(**env):
        environment = environment_of(dry_run("-n", "2", "--", "t.py", env=clean_env(**env)))
        return [entry for entry in environment if entry.startswith("GLIBC_TUNABLES=")]
    assert tunables() == ["GLIBC_TUNABLES=glibc.malloc.hugetlb=1"]
    assert tunables(GLIBC_TUNABLES="glibc.malloc.arena_max=2") == [
        "GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"]
    assert tunables(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == ["GLIBC_TUNABLES=glibc.malloc.hugetlb=0"]


def test_a_program_that_is_not_python_runs_as_it_is():
    assert command_of(dry_run("-n", "2", "--", "hostname")).endswith(" GLIBC_TUNABLES glibc.malloc.hugetlb=1 hostname")


def test_python_interpreter_wraps_the_program_and_an_empty_one_runs_it_directly():
    wrapped = command_of(dry_run("-n", "2", "--python-interpreter", "valgrind --leak-check=yes python3", "--",
                                 "train.py", "-v"))
    assert wrapped.endswith(" GLIBC_TUNABLES glibc.malloc.hugetlb=1 valgrind --leak-check=yes python3 " + RANK_ENTRY + " train.py -v")
    direct = command_of(dry_run("-n", "2", "--python-interpreter", "", "--", "./tool.py", "-v"))
    assert direct.endswith(" GLIBC_TUNABLES glibc.malloc.hugetlb=1 ./tool.py -v")


def test_help_and_version_answer_at_once_without_tensorflow_or_mpi():
    started = time.monotonic()
    process = run_launcher("--help")
    assert_ok(process)
    assert time.monotonic() - started < 5
    for flag in ["--hostfile", "--n-per-node", "--devices-per-node", "--npernode", "--no-gpu", "--pin-to-socket",
                 "--pin-memory-to-socket", "--python-interpreter", "--cleanup", "--force", "--dry-run"]:
        assert flag in process.stdout
    probe = ("import sys; sys.argv = ['tarantella', '--version']\n"
             "import tarantella.launcher\n"
             "try:\n    tarantella.launcher.main()\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('tensorflow', 'keras', 'mpi4py.MPI') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert imported.stdout.splitlines() == [f"tarantella {tarantella_version()}", "[]"]


def tarantella_version():
    text = (REPO / "tarantella" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def test_malformed_options_are_refused():
    for arguments, message in [(["-x", "NOVALUE", "--", "t.py"], "-x expects VAR=VALUE, got 'NOVALUE'"),
                               (["-n", "0", "--", "t.py"], "expects a whole number of ranks >= 1"),
                               (["--n-per-node", "x", "--", "t.py"], "expects a whole number of ranks >= 1"),
                               (["--log-level", "LOUD", "--", "t.py"], "invalid choice: 'LOUD'"),
                               (["--force", "--", "t.py"], "--force only goes with --cleanup"),
                               (["-n", "2"], "name the program after '--'"),
                               (["-n", "2", "train.py", "-v"], "put the program after '--': tarantella -n 2 -- "
                                                               "train.py -v"),
                               (["-n", "2", "--bogus", "--", "t.py"], "unrecognized arguments: --bogus")]:
        assert message in refused(*arguments)


def test_a_missing_script_or_launcher_is_reported_once_before_any_rank_starts(tmp_path):
    process = run_launcher("-n", "2", "--", str(tmp_path / "missing.py"))
    assert process.returncode == 2
    assert process.stderr == (f"tarantella: error: the program '{tmp_path / 'missing.py'}' does not exist (in "
                              f"{os.getcwd()}). Name the script to run after '--', e.g. tarantella -n 2 -- "
                              "train.py.\n")
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    process = run_launcher("-n", "2", "--", str(script), env=clean_env(TNT_MPIEXEC="/nowhere/mpiexec -v"))
    assert process.returncode == 2
    assert process.stderr == ("tarantella: error: TNT_MPIEXEC='/nowhere/mpiexec -v' names '/nowhere/mpiexec', "
                              "which is not an executable program (nor on PATH). Fix TNT_MPIEXEC, or unset it to "
                              "use mpiexec.\n")
    process = run_launcher("-n", "2", "--python-interpreter", "/nowhere/python -u", "--", str(script))
    assert process.returncode == 2
    assert process.stderr == ("tarantella: error: the interpreter '/nowhere/python' (--python-interpreter) is not an "
                              "executable program (nor on PATH). Name one that exists on every host at the same "
                              "path.\n")


def test_only_tensorflows_own_tf_variables_are_forwarded():
    env = clean_env(TF_CLI_CONFIG_FILE="/home/u/.terraformrc", TF_VAR_region="eu", TF_ENABLE_ONEDNN_OPTS="0",
                    TF_FORCE_GPU_ALLOW_GROWTH="true", TF_XLA_FLAGS="--tf_xla_auto_jit=2")
    environment = environment_of(dry_run("-n", "2", "--", "t.py", env=env))
    assert [entry for entry in environment if entry.startswith("TF_")] == [
        "TF_ENABLE_ONEDNN_OPTS=0", "TF_FORCE_GPU_ALLOW_GROWTH=true", "TF_XLA_FLAGS=--tf_xla_auto_jit=2"]


def test_jax_and_xla_settings_reach_every_rank():
    env = clean_env(JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_PYTHON_CLIENT_MEM_FRACTION=".4")
    environment = environment_of(dry_run("-n", "2", "--", "t.py", env=env))
    assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in environment
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=.4" in environment


# -- hosts: hostfile and Slurm -------------------------------------------------------------------

def test_hostfile_places_ranks_per_node_with_each_alias_of_n_per_node(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# our nodes\nnode-a\n\nnode-b  # the second\n")
    for alias in ["--n-per-node", "--devices-per-node", "--npernode"]:
        output = dry_run("--hostfile", str(hostfile), alias, "2", "--no-gpu", "--", "t.py")
        assert " -hosts node-a:2,node-b:2 -ppn 2 -n 4 " in command_of(output)
        assert output.splitlines()[-1] == "ranks: 4 (2 per node on node-a, node-b, CPU)"
    assert " -hosts node-a:3,node-b:3 -ppn 3 -n 6 " in command_of(dry_run("--hostfile", str(hostfile), "-n", "6",
                                                                   "--no-gpu", "--", "t.py"))


def test_bad_hostfiles_and_rank_counts_are_refused_with_the_fix(tmp_path):
    duplicates, empty, slots = tmp_path / "duplicates", tmp_path / "empty", tmp_path / "slots"
    duplicates.write_text("node-a\nnode-b\nnode-a\n")
    empty.write_text("# nothing yet\n\n")
    slots.write_text("node-a slots=4\n")
    good = tmp_path / "good"
    good.write_text("node-a\nnode-b\n")
    for arguments, message in [
            (["--hostfile", str(duplicates)], f"{duplicates}, line 3: host 'node-a' is listed twice"),
            (["--hostfile", str(empty)], f"the hostfile {str(empty)!r} names no host"),
            (["--hostfile", str(slots)], "is not a host name. Write one host name per line and give the ranks "
                                         "per node with --n-per-node"),
            (["--hostfile", str(tmp_path / "missing")], "cannot read the hostfile"),
            (["--hostfile", str(good), "-n", "3"], "-n 3 ranks cannot be spread evenly over 2 nodes"),
            (["--hostfile", str(good), "-n", "4", "--n-per-node", "3"], "-n 4 does not equal --n-per-node 3 x 2")]:
        stderr = refused(*arguments, "--", "t.py")
        assert stderr.startswith("tarantella: error: ") and message in stderr, stderr


def test_inside_slurm_the_allocation_gives_hosts_and_tasks_per_node(tmp_path):
    slurm = clean_env(SLURM_JOB_ID="42", SLURM_JOB_NODELIST="node[01-03,07],gpu[1-2]-ib",
                      SLURM_NTASKS_PER_NODE="2")
    output = dry_run("--", "t.py", env=slurm)
    assert " -hosts node01:2,node02:2,node03:2,node07:2,gpu1-ib:2,gpu2-ib:2 -ppn 2 -n 12 " in command_of(output)
    tasks_only = clean_env(SLURM_JOB_NODELIST="c[9-11]", SLURM_TASKS_PER_NODE="3(x3)")
    assert " -hosts c9:3,c10:3,c11:3 -ppn 3 -n 9 " in command_of(dry_run("--", "t.py", env=tasks_only))
    assert " -hosts c9:1,c10:1,c11:1 -ppn 1 -n 3 " in command_of(dry_run("--n-per-node", "1", "--", "t.py",
                                                                  env=tasks_only))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("mine\n")
    assert " -hosts mine:1 -ppn 1 -n 1 " in command_of(dry_run("--hostfile", str(hostfile), "--", "t.py", env=slurm))


def test_srun_as_the_launcher_gets_tasks_nodes_and_variables_through_env(tmp_path):
    srun = fake_tool(tmp_path, "srun", 'echo "slurm 23.11.4"\n')
    fake_tool(tmp_path, "scontrol", 'echo "MpiDefault              = none"\n')  # Slurm's own default
    env = clean_env(SLURM_JOB_NODELIST="n[1-2]", SLURM_NTASKS_PER_NODE="2", TNT_MPIEXEC=str(srun))
    command = command_of(dry_run("-x", "DATA=/a,b", "--", "t.py", env=env))
    # The venv's MPI is the mpich wheel (Hydra's family): srun's PMI-2 plug-in lets its ranks meet.
    assert command.startswith(f"{srun} --ntasks=4 --ntasks-per-node=2 --kill-on-bad-exit=1 --nodes=2 "
                              "--nodelist=n1,n2 --mpi=pmi2 env PYTHONUNBUFFERED=1 ")
    assert " DATA=/a,b " in command and command.endswith(f" {RANK_ENTRY} t.py")


def test_srun_keeps_the_pmi_plugin_that_the_user_or_the_cluster_chose(tmp_path):
    srun = fake_tool(tmp_path, "srun", 'echo "slurm 23.11.4"\n')
    scontrol = fake_tool(tmp_path, "scontrol", 'echo "MpiDefault              = none"\n')
    allocation = clean_env(SLURM_JOB_NODELIST="n[1-2]", SLURM_NTASKS_PER_NODE="1")
    chosen_in_the_command = dict(allocation, TNT_MPIEXEC=f"{srun} --mpi=pmix")
    assert " --mpi=pmix --ntasks=2 " in command_of(dry_run("--", "t.py", env=chosen_in_the_command))
    assert "pmi2" not in dry_run("--", "t.py", env=chosen_in_the_command)
    chosen_in_the_environment = dict(allocation, TNT_MPIEXEC=str(srun), SLURM_MPI_TYPE="pmix")
    assert "--mpi" not in command_of(dry_run("--", "t.py", env=chosen_in_the_environment))
    scontrol.write_text('#!/bin/sh\necho "MpiDefault              = pmix"\n')
    chosen_by_the_cluster = dict(allocation, TNT_MPIEXEC=str(srun))
    assert "--mpi" not in command_of(dry_run("--", "t.py", env=chosen_by_the_cluster))


def test_an_allocation_with_different_tasks_per_node_is_refused_unless_n_says_how_many():
    uneven = clean_env(SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2,1")
    assert ("tarantella: error: the Slurm allocation has different numbers of tasks per node "
            "(SLURM_TASKS_PER_NODE=2,1), and tarantella runs as many ranks on every node. Ask Slurm for the "
            "same number on each (--ntasks-per-node), or give -n or --n-per-node.") in refused("--", "t.py", env=uneven)
    assert " -hosts n1:1,n2:1 -ppn 1 -n 2 " in command_of(dry_run("-n", "2", "--", "t.py", env=uneven))


# -- devices -------------------------------------------------------------------------------------

NO_GPU_WARNING = "tarantella: WARNING: no GPU found, so one rank per node runs on CPU"


def test_without_n_every_gpu_gets_a_rank_and_without_gpus_one_cpu_rank_warns(tmp_path):
    fake_tool(tmp_path, "nvidia-smi", 'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    with_gpus = clean_env(PATH=f"{tmp_path}:{os.environ['PATH']}")
    del with_gpus["CUDA_VISIBLE_DEVICES"]
    process = run_launcher("--dry-run", "--", "t.py", env=with_gpus)
    assert_ok(process)
    assert " -n 4 " in command_of(process.stdout) and "TNT_USE_GPU" not in process.stdout
    assert process.stdout.splitlines()[-1] == "ranks: 4 (4 per node on this node, GPU)"
    assert "WARNING" not in process.stderr
    visible = dict(with_gpus, CUDA_VISIBLE_DEVICES="2,3,-1,0")  # CUDA stops at the first invalid entry
    assert " -n 2 " in command_of(dry_run("--", "t.py", env=visible))

    process = run_launcher("--dry-run", "--", "t.py")  # no GPU
    assert " -n 1 " in command_of(process.stdout) and "TNT_USE_GPU=false" in process.stdout
    assert NO_GPU_WARNING in process.stderr
    assert "WARNING" not in run_launcher("--dry-run", "--no-gpu", "--", "t.py").stderr
    assert "tarantella: WARNING: 2 ranks per node but no GPU(s), so every rank runs on CPU. --no-gpu " \
           "silences this warning." in run_launcher("--dry-run", "-n", "2", "--", "t.py").stderr
    assert "WARNING" not in run_launcher("--dry-run", "-n", "2", "--no-gpu", "--", "t.py").stderr


def test_more_ranks_than_gpus_run_on_cpu_with_a_warning_that_no_gpu_silences(tmp_path):
    gpus = clean_env(CUDA_VISIBLE_DEVICES="0,1")
    process = run_launcher("--dry-run", "-n", "4", "--", "t.py", env=gpus)
    assert "TNT_USE_GPU=false" in process.stdout
    assert "tarantella: WARNING: 4 ranks per node but only 2 GPU(s), so every rank runs on CPU" in process.stderr
    quiet = run_launcher("--dry-run", "-n", "4", "--no-gpu", "--", "t.py", env=gpus)
    assert "TNT_USE_GPU=false" in quiet.stdout and quiet.stderr == ""
    on_cpu_anyway = run_launcher("--dry-run", "-n", "2", "--no-gpu", "--", "t.py", env=gpus)
    assert "TNT_USE_GPU=false" in on_cpu_anyway.stdout
    assert "TNT_USE_GPU" not in run_launcher("--dry-run", "-n", "2", "--", "t.py", env=gpus).stdout
    shared = run_launcher("--dry-run", "-n", "4", "--", "t.py", env=dict(gpus, TNT_SHARE_GPUS="true"))
    assert "TNT_USE_GPU" not in shared.stdout and "WARNING" not in shared.stderr
    assert shared.stdout.splitlines()[-1] == "ranks: 4 (4 per node on this node, GPU)"


def test_each_rank_of_a_node_picks_its_own_gpu_or_shares_them_only_when_asked(monkeypatch):
    """The rank's side of the placement above (tests/test_gpu.py runs it on real GPUs)."""
    from tarantella.backends import devices
    from tarantella.backends.devices import gpu_of_this_rank as _gpu_of_this_rank
    warnings = []
    monkeypatch.setattr(devices.logger, "warning", lambda message, *values: warnings.append(message % values))
    monkeypatch.delenv("TNT_SHARE_GPUS", raising=False)
    monkeypatch.delenv("TNT_USE_GPU", raising=False)
    assert [_gpu_of_this_rank(rank, 4, 4) for rank in range(4)] == [0, 1, 2, 3]
    assert _gpu_of_this_rank(0, 2, 0) is None and not warnings
    assert _gpu_of_this_rank(2, 3, 2) is None and "3 ranks on this node but 2 GPU(s)" in warnings[0]
    monkeypatch.setenv("TNT_SHARE_GPUS", "true")
    assert [_gpu_of_this_rank(rank, 3, 2) for rank in range(3)] == [0, 1, 0]
    monkeypatch.setenv("TNT_USE_GPU", "false")
    assert _gpu_of_this_rank(0, 1, 1) is None


# -- pinning -------------------------------------------------------------------------------------

def test_pinning_without_numactl_or_with_too_few_numa_nodes_is_refused(tmp_path):
    no_numactl = clean_env(PATH=str(tmp_path))
    assert "need numactl, which is not on PATH" in refused("-n", "1", "--pin-to-socket", "--", "t.py",
                                                           env=no_numactl)
    fake_tool(tmp_path, "numactl", 'echo "available: 1 nodes (0)"\n')
    assert "cannot pin 2 ranks per node to sockets: this node has 1 NUMA node(s)" in refused(
        "-n", "2", "--pin-memory-to-socket", "--", "t.py", env=no_numactl)


def numactl_with_two_nodes(directory):
    """Reports two NUMA nodes; runs the command unpinned, telling it the binding it was given."""
    return fake_tool(directory, "numactl", 'if [ "$1" = --hardware ]; then echo "available: 2 nodes (0-1)"; '
                                           'exit; fi\nbinding="$1 $2"; shift 2\n'
                                           'NUMACTL_BINDING="$binding" exec "$@"\n')


def test_pinning_binds_each_rank_to_the_numa_node_of_its_local_rank(tmp_path):
    numactl_with_two_nodes(tmp_path)
    env = clean_env(PATH=f"{tmp_path}:{os.environ['PATH']}")
    command = command_of(dry_run("-n", "2", "--pin-to-socket", "--", "t.py", env=env))
    assert (" sh -c 'exec numactl --cpunodebind=$MPI_LOCALRANKID --preferred=$MPI_LOCALRANKID \"$@\"' "
            "numactl-by-local-rank ") in command
    both = command_of(dry_run("-n", "2", "--pin-to-socket", "--pin-memory-to-socket", "--", "t.py", env=env))
    assert "--cpunodebind=$MPI_LOCALRANKID --membind=$MPI_LOCALRANKID" in both


def test_ranks_run_under_the_interpreter_wrapper_and_their_numa_binding(tmp_path):
    numactl_with_two_nodes(tmp_path)
    env = quiet_env(PATH=f"{tmp_path}:{os.environ['PATH']}")
    process = launch(2, SCENARIOS, "identity", "WRAPPED", "NUMACTL_BINDING", timeout=120, env=env,
                     options=["--pin-memory-to-socket", "--pin-to-socket",
                              "--python-interpreter", f"env WRAPPED=yes {sys.executable}"])
    assert_ok(process)
    for rank in range(2):
        assert f"rank {rank}: WRAPPED=yes" in process.stdout
        assert f"rank {rank}: NUMACTL_BINDING=--cpunodebind={rank} --membind={rank}" in process.stdout


CORES_SEEN = WORKERS / "cores_seen.py"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to share")
def test_ranks_that_share_cores_split_them_and_bound_ranks_keep_theirs():
    """XLA's and the input pipeline's thread pools are sized to the cores a rank may use: unbound
    ranks each size theirs to the whole node. Here rank 0 is bound to one core before tarantella
    starts, as Open MPI or Slurm would bind it: it keeps that core, while ranks 1 and 2, free to use
    them all, split them, every thread of theirs included (the communicator's, started earlier)."""
    everything = sorted(os.sched_getaffinity(0))
    seen = cores_seen(launch(3, CORES_SEEN, env={"BIND_RANK_0_FIRST": "1"}, timeout=120), 3)
    half = len(everything) // 2
    assert seen[0] == ([everything[0]], True, 1), seen
    assert sorted(seen[1][0] + seen[2][0]) == everything and len(seen[1][0]) in (half, len(everything) - half), seen
    assert all(seen[rank][1] and seen[rank][2] == len(seen[rank][0]) for rank in (1, 2)), seen
    unbound = cores_seen(launch(2, CORES_SEEN, env={"TNT_BIND_CORES": "false"}, timeout=120), 2)
    assert [unbound[rank][0] for rank in (0, 1)] == [everything, everything], unbound


def test_an_empty_interpreter_runs_a_binary_on_every_rank(tmp_path):
    tool = fake_tool(tmp_path, "tool.py", 'echo "tool on rank $PMI_RANK of $PMI_SIZE: $*"\n')
    process = launch(2, tool, "a b", options=["--python-interpreter", ""], timeout=60)
    assert_ok(process)
    assert sorted(process.stdout.splitlines()) == ["tool on rank 0 of 2: a b", "tool on rank 1 of 2: a b"]


# -- cleanup -------------------------------------------------------------------------------------

def test_cleanup_stops_a_running_job_and_force_kills_what_ignores_sigterm(tmp_path):
    sleeper = tmp_path / f"sleeper_{os.getpid()}.py"
    sleeper.write_text("import signal, sys, time\n"
                       "if 'stubborn' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                       "import os; os.write(1, b'ready\\n')  # one write: the ranks' lines must not interleave\n"
                       "time.sleep(300)\n")
    job = subprocess.Popen(launcher_command() + ["-n", "2", "--", str(sleeper)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=clean_env())
    stubborn = subprocess.Popen([sys.executable, str(sleeper), "stubborn"], stdout=subprocess.PIPE, text=True)
    try:
        assert [job.stdout.readline(), job.stdout.readline(), stubborn.stdout.readline()] == ["ready\n"] * 3
        polite = run_launcher("--cleanup", "--", sleeper.name)
        assert polite.returncode == 1
        assert f"sent SIGTERM to" in polite.stdout and "Try --force." in polite.stdout
        assert job.wait(timeout=30) != 0
        assert stubborn.poll() is None
        forced = run_launcher("--cleanup", "--force", "--", sleeper.name)
        assert_ok(forced)
        assert f"sent SIGKILL to 1 process(es) running {sleeper.name}." in forced.stdout
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
    finally:
        for process in (job, stubborn):
            if process.poll() is None:
                process.kill()


def test_cleanup_reaches_every_host_of_the_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a\nnode-b\n")
    command = command_of(dry_run("--hostfile", str(hostfile), "--cleanup", "--force", "--", "train.py"))
    assert re.search(r" -hosts node-a:1,node-b:1 -ppn 1 -n 2 \S*python[\d.]* -m tarantella.launcher "
                     r"_stop-processes-here SIGKILL train\.py$", command), command


def test_ranks_see_their_rank_size_and_the_x_variables():
    process = launch(3, SCENARIOS, "identity", "GREETING", "EMPTY",
                     options=["-x", "GREETING=hello world", "EMPTY="], timeout=120)
    assert_ok(process)
    # TensorFlow's C++ start-up messages (oneDNN, absl's banner) are not shown by default
    assert "oneDNN" not in process.stderr and "absl::InitializeLog" not in process.stderr, process.stderr
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


def test_log_lines_come_from_the_master_unless_every_rank_is_asked_and_carry_the_rank():
    default = launch(2, SCENARIOS, "log-messages", timeout=120)
    assert_ok(default)
    assert [l for l in default.stderr.splitlines() if "from rank" in l] == ["[tarantella] WARNING: warning from rank 0"]
    everywhere = launch(2, SCENARIOS, "log-messages", options=["--log-on-all-devices", "--log-level", "INFO"],
                        timeout=120)
    assert_ok(everywhere)
    assert sorted(l for l in everywhere.stderr.splitlines() if "from rank" in l) == [
        "[tarantella rank 0] INFO: info from rank 0", "[tarantella rank 0] WARNING: warning from rank 0",
        "[tarantella rank 1] INFO: info from rank 1", "[tarantella rank 1] WARNING: warning from rank 1"]


def test_cleanup_dry_run_on_this_node_stops_nothing():
    output = dry_run("--cleanup", "--", "/some/where/train.py")
    assert output == "would send SIGTERM to your processes on this node whose command line names train.py\n"


@pytest.mark.parametrize("name, value, says", [
    ("TNT_COLLECTIVE_TIMEOUT", "nan", "TNT_COLLECTIVE_TIMEOUT='nan' must be a finite number of seconds >= 1"),
    ("TNT_STALL_WARNING", "inf", "TNT_STALL_WARNING='inf' must be a finite number of seconds >= 1"),
    ("TNT_START_TIMEOUT", "soon", "TNT_START_TIMEOUT='soon' is not a number of seconds"),
    ("TNT_LOG_LEVEL", "loud", "TNT_LOG_LEVEL='LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
    ("TNT_BIND_CORES", "sometimes", "TNT_BIND_CORES='sometimes' is not a boolean"),
    ("TNT_SHARE_GPUS", "maybe", "TNT_SHARE_GPUS='maybe' is not a boolean"),
])
def test_a_bad_setting_is_refused_in_one_line_before_any_rank_starts(name, value, says):
    # nan compares false with every bound, so a nan timeout used to let a frozen rank hang the job.
    stderr = refused("-n", "2", "--", str(WORKERS / "plain_ranks.py"), env=clean_env(**{name: value}))
    assert stderr.startswith(f"tarantella: error: {says}"), stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr


def test_a_misspelt_setting_is_named_with_the_setting_it_resembles_and_a_foreign_one_is_left_alone():
    process = run_launcher("--dry-run", "-n", "2", "--", "train.py",
                           env=clean_env(TNT_COLECTIVE_TIMEOUT="30", TNT_MY_PROJECT_DATA="/data"))
    assert_ok(process)
    assert ("tarantella: WARNING: TNT_COLECTIVE_TIMEOUT is not a tarantella setting, so it is ignored; did "
            "you mean TNT_COLLECTIVE_TIMEOUT?") in process.stderr
    assert "TNT_MY_PROJECT_DATA" not in process.stderr


def test_without_the_launcher_a_bad_setting_fails_at_import_with_the_fix():
    process = subprocess.run([sys.executable, "-c", "import tarantella; tarantella.init()"], capture_output=True,
                             text=True, timeout=120, env=clean_env(TNT_COLLECTIVE_TIMEOUT="nan"))
    assert process.returncode != 0
    assert "ValueError: TNT_COLLECTIVE_TIMEOUT='nan' must be a finite number of seconds >= 1" in process.stderr
