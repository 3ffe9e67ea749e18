"""Saving: the master writes, and every file appears whole.

A save goes to a hidden file in the target's folder, which is then
renamed over the target: a crash mid-write leaves the previous file as it was. Only the master
writes unless `tnt_save_all_devices=True`; every rank returns once the file is complete, and
if a write fails every rank raises. Saved files are plain Keras files, so a serial program
reads them with `keras.models.load_model`.
"""

import contextlib
import os
import socket
import uuid

from tarantella.common import backup_files
from tarantella.runtime import events, world

_master_alone = False  # True while a master-only callback runs: the other ranks are not saving


@contextlib.contextmanager
def master_alone():
    """Saves inside this block are made by the master without waiting for the other ranks."""
    global _master_alone
    previous, _master_alone = _master_alone, True
    try:
        yield
    finally:
        _master_alone = previous


def write_whole(filepath, write, overwrite=True, save_all_devices=False):
    """Calls `write(partial_path)` on the writing ranks and renames the result to `filepath`."""
    comm = world.init()
    path = os.fspath(filepath)
    if "://" in path:
        raise ValueError(f"tarantella saves to local or shared file systems; {path!r} is a remote URL. "
                         "Save to a local path, then copy the file.")
    writes_here = save_all_devices or _master_alone or comm.rank == world.MASTER_RANK
    together = comm.size > 1 and not _master_alone
    if not overwrite:
        # Decided before anyone writes: a rank looking after the master's rename would see
        # the new file and fail.
        exists = writes_here and os.path.exists(path)
        if together:
            exists = any(comm.allgather(exists, f"the check whether {path} exists",
                                        agree_on="the check whether a saved file exists"))
        if exists:
            raise FileExistsError(f"{path} exists and overwrite=False. Pass overwrite=True to replace it, "
                                  "or choose another path.")
    error = None
    if writes_here:
        try:
            with events.span(f"save {os.path.basename(path)}"):
                _write_then_rename(path, write)
        except Exception as exc:  # reported to every rank below, then raised here
            error = exc
    if together:
        reports = comm.allgather(None if error is None else f"{type(error).__name__}: {error}",
                                 f"the save of {path}", agree_on="the save of a file")
        failed = [(rank, report) for rank, report in enumerate(reports) if report]
        if failed and error is None:
            rank, report = failed[0]
            consequence = OSError(f"Saving {path} failed on rank {rank}: {report}")
            consequence.culprit = rank  # the launcher names that rank, whose own error is the cause
            raise consequence
    if error is not None:
        raise error




def _write_then_rename(path, write):
    folder, name = os.path.split(os.path.abspath(path))
    backup_files.remove_abandoned_partial_files(folder, name)
    # The partial file keeps the target's name as its suffix (Keras checks the extension), and
    # the writer's host and process, so that a later save can tell an abandoned one.
    partial = os.path.join(folder, f"{backup_files.PARTIAL_PREFIX}{socket.gethostname()}-{os.getpid()}-"
                                   f"{uuid.uuid4().hex[:12]}-{name}")
    try:
        write(partial)
        os.replace(partial, path)
    except Exception as error:
        renamed = _naming_the_target(error, partial, path)
        if renamed is error:
            raise
        raise renamed from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _naming_the_target(error, partial, path):
    """The same error, its message naming the file the user asked for, not the hidden one."""
    if partial not in str(error):
        return error
    if isinstance(error, OSError):
        return type(error)(error.errno, error.strerror, path)
    try:
        return type(error)(str(error).replace(partial, path))
    except Exception:  # an error type that wants other arguments keeps its message
        return error
