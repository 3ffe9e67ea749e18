"""Saving: the master writes, and every file appears whole.

A save goes to a hidden file in the target's folder, which is then
renamed over the target: a crash mid-write leaves the previous file as it was. Only the master
writes unless `tnt_save_all_devices=True`; every rank returns once the file is complete, and
if a write fails every rank raises. Saved files are plain Keras files, so a serial program
reads them with `keras.models.load_model`.
"""

import contextlib
import os
import uuid

import keras

from tarantella import communication

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
    comm = communication.init()
    path = os.fspath(filepath)
    if "://" in path:
        raise ValueError(f"tarantella saves to local or shared file systems; {path!r} is a remote URL. "
                         "Save to a local path, then copy the file.")
    error = None
    if save_all_devices or _master_alone or comm.rank == communication.MASTER_RANK:
        try:
            _write_then_rename(path, write, overwrite)
        except Exception as exc:  # reported to every rank below, then raised here
            error = exc
    if comm.size > 1 and not _master_alone:
        reports = comm.allgather(None if error is None else f"{type(error).__name__}: {error}",
                                 f"the save of {path}")
        failed = [(rank, report) for rank, report in enumerate(reports) if report]
        if failed and error is None:
            rank, report = failed[0]
            raise OSError(f"Saving {path} failed on rank {rank}: {report}")
    if error is not None:
        raise error


def _write_then_rename(path, write, overwrite):
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path} exists and overwrite=False. Pass overwrite=True to replace it, "
                              "or choose another path.")
    folder, name = os.path.split(os.path.abspath(path))
    # The partial file keeps the target's name as its suffix: Keras checks the extension.
    partial = os.path.join(folder, f".tnt-partial-{uuid.uuid4().hex[:12]}-{name}")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
