"""The lock file of a file cache while a pass writes it.

Words:
    lock file: ``<cache file>.lock``, made by the pass that writes the cache file and
        removed when the pass ends. It holds one line, ``pid <process id> host <host
        name>``, and its writer keeps it open under an exclusive ``flock``, which the
        system drops when the process ends however it ends.
    stale lock: a lock file that no process holds, whose writer ran on this host and no
        longer runs: a process that died mid-pass. The next pass takes it over, with a
        warning, and removes the dead writer's partial file. A lock held by a live
        process, or written on another host (whose processes cannot be looked at from
        here), is a FileExistsError naming the lock file and its owner.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import socket

log = logging.getLogger("gpustrat")


def take_lock(lock: str, path: str):
    """Hold the lock file of the cache file ``path`` (an open file, under an exclusive
    ``flock`` that the system releases when its process ends): raise FileExistsError
    naming its owner while a live writer holds it; take over, with a warning, a lock
    whose writer stopped without removing it (its process died mid-pass)."""
    host = socket.gethostname()
    while True:
        held = open(lock, "a+b")
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner_of(held)
            held.close()
            raise FileExistsError(
                f"cache: another iterator is writing the cache {path!r}: its lock file "
                f"{lock!r} is held by {_describe_owner(owner)}. Two passes cannot fill "
                "one cache file at once: give each process or iterator its own filename, "
                "or wait for that pass to end") from None
        try:
            replaced = os.stat(lock).st_ino != os.fstat(held.fileno()).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # its last writer finished and removed it: take the new one
            held.close()
            continue
        owner = _owner_of(held)
        if owner is not None:
            pid, at = owner
            if at not in (None, host) or (pid != os.getpid() and _alive(pid)):
                # Another machine's writer (whose process cannot be looked at from
                # here), or a live process that writes without holding the lock.
                held.close()
                raise FileExistsError(
                    f"cache: the lock file {lock!r} of the cache {path!r} names "
                    f"{_describe_owner(owner)}, which may still be writing it. Two passes "
                    "cannot fill one cache file at once: give each process its own "
                    "filename; if that process is not writing, delete the lock file")
            log.warning("cache: taking over the lock file %r of the cache %r: process %s "
                        "on this host stopped while writing it and no longer runs (its "
                        "partial file is removed)", lock, path, pid)
            for name in glob.glob(f"{glob.escape(path)}.tmp-{pid}-*"):
                remove(name)
        held.seek(0)
        held.truncate()
        held.write(f"pid {os.getpid()} host {host}\n".encode())
        held.flush()
        return held


def _owner_of(held) -> tuple | None:
    """``(pid, host)`` written in a lock file (host None in lock files that do not name
    one), or None for an empty one (its writer has not written yet)."""
    held.seek(0)
    words = held.read().decode(errors="replace").split()
    if len(words) < 2 or words[0] != "pid" or not words[1].isdigit():
        return None
    return int(words[1]), words[3] if len(words) >= 4 and words[2] == "host" else None


def _describe_owner(owner) -> str:
    if owner is None:
        return "a process that has not written its id yet"
    pid, host = owner
    return f"process {pid}" + (f" on host {host!r}" if host else "")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True



def remove(path: str) -> None:
    """Remove ``path`` if it exists."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
