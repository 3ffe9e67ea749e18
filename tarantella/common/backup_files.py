"""The files of automatic backups: one file per `fit` call of the program, written whole or not at all.

A backup file is a line naming the format, a line of JSON (where training stands, and where
each array lies in the file), then the arrays' raw bytes. The `tarantella` command reads the
JSON line to say where a restart resumes, without NumPy or TensorFlow; the ranks read the arrays.

Names are `fit-<k>.tntbackup`, k counting the program's `fit` calls from 1, so that a program
restarted from its top finds each call's backup again.
"""

import contextlib
import json
import os
import re
import socket

_FORMAT_LINE = b"tarantella backup 1\n"
_SUFFIX = ".tntbackup"
_NAME = re.compile(r"fit-(\d+)\.tntbackup")
PARTIAL_PREFIX = ".tnt-partial-"  # backups and tnt.models saves alike: a name a later clean-up recognizes
_ALIGNMENT = 64


def path_of(directory, fit_number):
    return os.path.join(directory, f"fit-{fit_number}{_SUFFIX}")


def write(path, header, arrays):
    """Writes `header` (a dict) and the NumPy `arrays` to `path`: to a partial file first, forced
    to the disk, then renamed over `path`. A crash leaves the previous backup as it was."""
    layout, offset = [], 0
    for array in arrays:
        offset = -(-offset // _ALIGNMENT) * _ALIGNMENT
        layout.append({"dtype": array.dtype.name, "shape": list(array.shape), "offset": offset,
                       "nbytes": array.nbytes})
        offset += array.nbytes
    head = _FORMAT_LINE + json.dumps({**header, "arrays": layout}).encode() + b"\n"
    folder, name = os.path.split(os.path.abspath(path))
    remove_abandoned_partial_files(folder, name)
    partial = os.path.join(folder, f"{PARTIAL_PREFIX}{socket.gethostname()}-{os.getpid()}-{name}")
    try:
        with open(partial, "wb") as file:
            file.write(head)
            start = len(head)
            for array, place in zip(arrays, layout):
                file.seek(start + place["offset"])
                file.write(array.reshape(-1).view("u1").data)  # no copy; any dtype
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    _sync_folder(folder)


def remove_abandoned_partial_files(folder, name):
    """Removes the partial files of `name` whose writer on this host is gone (killed while it wrote)."""
    host = socket.gethostname()
    try:
        entries = os.listdir(folder)
    except OSError:
        return  # the write itself will report the folder
    for entry in entries:
        if not (entry.startswith(f"{PARTIAL_PREFIX}{host}-") and entry.endswith(f"-{name}")):
            continue
        pid = entry[len(PARTIAL_PREFIX) + len(host) + 1:].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


def read_header(path):
    """The JSON line of a backup file (without the arrays), or None if there is no such file."""
    try:
        with open(path, "rb") as file:
            if file.readline() != _FORMAT_LINE:
                raise ValueError(f"{path} is not a tarantella backup file (or one of another version). Remove it, "
                                 "or give --backup-dir a folder of its own.")
            return json.loads(file.readline())
    except FileNotFoundError:
        return None


def read_arrays(path):
    """The header and the arrays of a backup file."""
    import numpy as np

    with open(path, "rb") as file:
        content = file.read()
    first = content.index(b"\n") + 1
    second = content.index(b"\n", first) + 1
    if content[:first] != _FORMAT_LINE:
        raise ValueError(f"{path} is not a tarantella backup file (or one of another version).")
    header = json.loads(content[first:second])
    arrays = [np.frombuffer(content, dtype=np.dtype(place["dtype"]), count=_count(place["shape"]),
                            offset=second + place["offset"]).reshape(tuple(place["shape"]))
              for place in header["arrays"]]
    return header, arrays


def _count(shape):
    count = 1
    for size in shape:
        count *= size
    return count


def latest(directory):
    """(fit number, header) of the backup of the latest `fit` call in `directory`, or None."""
    try:
        numbers = sorted(int(match.group(1)) for match in map(_NAME.fullmatch, os.listdir(directory)) if match)
    except FileNotFoundError:
        return None
    for number in reversed(numbers):
        header = read_header(path_of(directory, number))
        if header is not None:
            return number, header
    return None


def is_ours(entry):
    """Whether a file in a backup folder was written by tarantella (and may be removed by it)."""
    return bool(_NAME.fullmatch(entry)) or (entry.startswith(PARTIAL_PREFIX) and entry.endswith(_SUFFIX))


def _sync_folder(folder):
    """The rename itself reaches the disk (else a host that loses power may forget it)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
