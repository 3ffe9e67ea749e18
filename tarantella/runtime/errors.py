"""The errors of collectives, the first one this process met, and the words that name a call."""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "RankFailedError", "RankLeftError"]


class CollectiveError(RuntimeError):
    """The ranks could not complete a collective together.

    Args:
        message: what went wrong, for the user.
        summary: one line for the `tarantella` command, or None.
        culprit: the rank whose failure (or absence) caused this error, when it is another one.

    Attributes:
        summary: one line for the `tarantella` command, or None.
        culprit: the rank whose failure (or absence) caused this error, when it is another one.
    """

    def __init__(self, message: str, summary: str | None = None, culprit: int | None = None) -> None:
        super().__init__(message)
        self.summary = summary
        self.culprit = culprit


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete because another rank did not take part in time."""


class RankLeftError(CollectiveError):
    """A rank finished the program while another one still needed it in a collective."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered different collectives (e.g. one in evaluate, another in fit)."""


class RankFailedError(CollectiveError):
    """Another rank failed in code only it runs (e.g. a master-only callback) and told this one."""


SAVE_HINT = (" If only the master calls save (`if tnt.is_master_rank(): model.save(...)`): call save on "
             "every rank; tarantella writes on the master only.")

# The first collective error of this process: TensorFlow wraps an error raised inside a step
# in its own UnknownError, and the user should see this one instead.
_first_failure = None


def remember(error):
    """Returns `error`, kept as this process's first failure if it is the first CollectiveError."""
    global _first_failure
    if _first_failure is None and isinstance(error, CollectiveError):
        _first_failure = error
    return error


def first_failure():
    """The first CollectiveError this process met, or None."""
    return _first_failure


def collective_failure_behind(error):
    """The CollectiveError that `error` is or wraps (TensorFlow turns an error raised inside a
    training step into an UnknownError carrying its text), else None."""
    if isinstance(error, CollectiveError):
        return error
    if _first_failure is not None and str(_first_failure) in str(error):
        return _first_failure
    return None


# The methods a user calls that run collectives, as named in the rank's messages.
_USER_CALLS = {"fit", "evaluate", "predict", "save", "save_weights", "save_model"}
_PACKAGE_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def with_call(what):
    """`what`, followed by the tarantella method the program called, e.g. "(in evaluate)".

    Read from the main thread's stack, so it costs nothing until a message needs it."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    call = None
    while frame is not None:
        code = frame.f_code
        if code.co_name in _USER_CALLS and code.co_filename.startswith(_PACKAGE_FOLDER):
            call = code.co_name  # the outermost wins: evaluate inside fit is fit's validation
        frame = frame.f_back
    return f"{what} (in {call})" if call else what
