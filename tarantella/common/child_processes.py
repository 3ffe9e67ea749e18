"""What the `tarantella` command's children share, whichever part of the command starts them."""

import signal


def end_with_parent():
    """Run in a child before it executes (subprocess's preexec_fn): the child gets SIGTERM should
    the command die, and stops what it started (the ranks, an attempt's ranks) in turn."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, Linux only
    except (OSError, AttributeError):
        pass
