"""The `tarantella` command: runs a program as ranks on this node, the hosts of a hostfile, or a
Slurm allocation, through the MPI launcher in use (Hydra's mpiexec, Open MPI's mpirun, or srun).

It imports neither TensorFlow nor MPI, so `tarantella --help` and `--dry-run` answer at once.
Its modules: command_line (options), placement (hosts, ranks per node, GPUs), mpis (one module
per MPI flavour, and the registry that picks one), job_command (the command line that runs the
ranks), job (running it), output_monitor (the ranks' output and reports, the culprit), cleanup
(--cleanup).
"""

import sys

from tarantella.common import config
from tarantella.common.hardware import count_gpus
from tarantella.launcher import cleanup, command_line, job, job_command, mpis, restarts
from tarantella.launcher.messages import LaunchError, say
from tarantella.launcher.placement import hosts_of_the_job, place_ranks


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [cleanup.STOP_HERE]:
        return cleanup.stop_processes_here(argv[1], argv[2])
    options, program = command_line.parse(argv)
    if restarts.supervises(options):
        return restarts.main(argv, options)
    try:
        try:
            setting_warnings = config.check_environment()
        except ValueError as error:
            raise LaunchError(str(error)) from None
        hosts = hosts_of_the_job(options)
        if options.cleanup:
            return cleanup.cleanup(options, program, hosts)
        mpi = mpis.identify(mpis.find_mpiexec())
        placement = place_ranks(options, hosts, count_gpus())
        command, environment = job_command.build(options, program, placement, mpi)
        command_line.check_program(options, program)
        command_line.check_interpreter_here(options, placement.hosts)
    except LaunchError as error:
        say(f"tarantella: error: {error}")
        return 2
    if options.log_level != "ERROR":
        for warning in setting_warnings + placement.warnings:
            say(f"tarantella: WARNING: {warning}")
    if options.log_level in ("INFO", "DEBUG"):
        for note in mpi.notes(environment):
            say(f"tarantella: INFO: {note}")
    if options.dry_run:
        job_command.print_dry_run(command, environment, placement)
        return 0
    ranks_announcing = placement.ranks if job_command.RANK_ENTRY in command else 0
    return job.run(command, environment, ranks_announcing, placement.hosts, config.start_timeout_s(), mpi)
