"""How the `tarantella` command speaks for itself: a refusal that names its fix, and its own
lines on stderr."""

import sys


class LaunchError(Exception):
    """A problem with the command line or this machine, explained with its fix."""


def say(line):
    """Writes one of the command's own lines to its stderr. A closed stderr (`2>&-`, where Python
    sets sys.stderr to None) or a reader that went away must not change how the job ends."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, BrokenPipeError, ValueError, OSError):
        pass
