"""Saving: the master writes, and every file appears whole.

A save goes to a hidden file in the target's folder, which is then
renamed over the target: a crash mid-write leaves the previous file as it was. Only the master
writes unless `tnt_save_all_devices=True`; every rank returns once the file is complete, and
if a write fails every rank raises. Saved files are plain Keras files, so a serial program
reads them with `keras.models.load_model`.

A master-only callback that writes in the background (ModelCheckpoint wrapped with
`write_in_background=True`) leaves the step as soon as the model's state is snapshot: a thread
has Keras write the file from a host copy of the model (model/host_copy.py). A model without a
host copy (a subclassed one) is written by Keras into the master's temporary folder (TMPDIR,
node-local on clusters) on the step, and the thread copies that into place. One such file is in
flight at a time: the next waits for it, and fit's end waits for the last.
"""

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid

from tarantella.common import backup_files
from tarantella.runtime import events, world

logger = logging.getLogger("tarantella")

_master_alone = False  # True while a master-only callback runs: the other ranks are not saving
_in_background = False  # True while such a callback's saves may be written into place by a thread


@contextlib.contextmanager
def master_alone(in_background=False):
    """Saves inside this block are made by the master without waiting for the other ranks; with
    `in_background`, a thread copies each into place while training goes on."""
    global _master_alone, _in_background
    previous = _master_alone, _in_background
    _master_alone, _in_background = True, in_background
    try:
        yield
    finally:
        _master_alone, _in_background = previous


def every_rank_saves():
    """Whether a save now is called on every rank (not by a master-only callback)."""
    return not _master_alone


def start_writer_thread(target, args, name):
    """Starts a thread that writes while training goes on, at the lowest CPU priority: it takes the
    time the ranks leave a core idle instead of slowing the step where every core computes."""
    def at_lowest_priority():
        with contextlib.suppress(AttributeError, OSError):  # Linux gives a thread a nice value of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        target(*args)
    thread = threading.Thread(target=at_lowest_priority, name=name)
    thread.start()
    return thread


class _BackgroundWrite:
    """The one file in flight, which a thread writes into place (then calls `done`)."""

    def __init__(self, path, write, done=lambda: None):
        self.path = path
        self.error = None
        self._thread = start_writer_thread(self._write_into_place, (write, done), "tarantella-checkpoint")

    def _write_into_place(self, write, done):
        started = time.monotonic()
        try:
            _write_then_rename(self.path, write)
            logger.debug("checkpoint %s: written into place by a thread in %.3f s", self.path,
                         time.monotonic() - started)
        except Exception as error:  # raised by wait_for_background_write
            self.error = error
        finally:
            done()

    def join(self):
        self._thread.join()


_in_flight = None


def wait_for_background_write():
    """Returns once the file a thread writes into place is there; raises if writing it failed."""
    global _in_flight
    write, _in_flight = _in_flight, None
    if write is None:
        return
    write.join()
    if write.error is not None:
        raise OSError(f"Writing the checkpoint {write.path} in the background failed: {write.error}. The file "
                      "there, if any, is the previous one, whole. Give the checkpoint a folder with room that "
                      "the master can write.") from write.error


def _write_in_background(path, write, frozen_write):
    """Snapshots the model for a thread that writes the file into place; without a host copy of the
    model, Keras writes it into the temporary folder now and the thread copies it."""
    global _in_flight
    started = time.monotonic()
    name = os.path.basename(path)
    with events.span(f"snapshot {name}"):
        write_later = frozen_write() if frozen_write is not None else None
    if write_later is not None:
        logger.debug("checkpoint %s: the step waited %.3f s", path, time.monotonic() - started)
        _in_flight = _BackgroundWrite(path, write_later)
        return
    folder = tempfile.gettempdir()
    backup_files.remove_abandoned_partial_files(folder, name)
    staged = _partial_path(folder, name)
    try:
        with events.span(f"stage {name}"):
            write(staged)
    except OSError as error:  # no room in the temporary folder: written in place, as without the option
        with contextlib.suppress(OSError):
            os.remove(staged)
        logger.warning("Could not stage %s in %s (%s); writing it in place while training waits.", name, folder,
                       error)
        _write_then_rename(path, write)
        return
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(staged)
        raise
    logger.debug("checkpoint %s: the step waited %.3f s", path, time.monotonic() - started)

    def remove_staged():
        with contextlib.suppress(OSError):
            os.remove(staged)
    _in_flight = _BackgroundWrite(path, lambda partial: shutil.copyfile(staged, partial), done=remove_staged)


def write_whole(filepath, write, overwrite=True, save_all_devices=False, frozen_write=None):
    """Calls `write(partial_path)` on the writing ranks and renames the result to `filepath`.

    `frozen_write`, for a save in the background: returns a function like `write` that writes the
    model as it is at this call from another thread while training goes on, or None."""
    comm = world.init()
    path = os.fspath(filepath)
    if "://" in path:
        raise ValueError(f"tarantella saves to local or shared file systems; {path!r} is a remote URL. "
                         "Save to a local path, then copy the file.")
    writes_here = save_all_devices or _master_alone or comm.rank == world.MASTER_RANK
    together = comm.size > 1 and not _master_alone
    background = _master_alone and _in_background and not save_all_devices
    if background:
        wait_for_background_write()  # one file in flight, and the overwrite check below sees it in place
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
    if background:
        _write_in_background(os.path.abspath(path), write, frozen_write)
        return
    error = None
    if writes_here:
        started = time.monotonic()
        try:
            with events.span(f"save {os.path.basename(path)}"):
                _write_then_rename(path, write)
            logger.debug("%s written in place in %.3f s", path, time.monotonic() - started)
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
    partial = _partial_path(folder, name)
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


def _partial_path(folder, name):
    # The partial file keeps the target's name as its suffix (Keras checks the extension), and
    # the writer's host and process, so that a later save can tell an abandoned one.
    return os.path.join(folder, f"{backup_files.PARTIAL_PREFIX}{socket.gethostname()}-{os.getpid()}-"
                                f"{uuid.uuid4().hex[:12]}-{name}")


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
