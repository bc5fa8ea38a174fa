"""The lock file of a file cache: a writer that died mid-pass leaves one behind, which
the next pass takes over with a warning; a live writer's is an error naming the lock
file and its owner; so is one written on another host."""

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpustrat.data import Dataset

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # for mpi_util
from mpi_util import repo_env  # noqa: E402

# Reads part of a file-cached dataset, so that its pass holds the lock, then says so
# and waits for stdin to close; then dies without any cleanup.
WRITER = r"""
import os, sys
from gpustrat.data import Dataset
it = iter(Dataset.range(10).cache(sys.argv[1]))
assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
print("WRITING", flush=True)
sys.stdin.read()
os._exit(1)
"""


def start_writer(path: str) -> subprocess.Popen:
    env = repo_env()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    except BaseException:
        proc.kill()
        raise
    return proc


def values(ds) -> list:
    return [int(x) for x in ds]


def test_a_live_writer_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog):
    path = str(tmp_path / "c")
    lock = path + ".gpustrat-cache.lock"
    writer = start_writer(path)
    try:
        with pytest.raises(FileExistsError) as e:
            values(Dataset.range(10).cache(path))
        assert f"its lock file {lock!r} is held by process {writer.pid} on host " \
            f"{socket.gethostname()!r}" in str(e.value), e.value
        assert "another iterator is writing the cache" in str(e.value)
    finally:
        writer.stdin.close()        # the writer dies mid-pass, its lock left behind
        assert writer.wait(timeout=60) == 1
    left = sorted(os.listdir(tmp_path))
    assert left == ["c.gpustrat-cache.lock",
                    f"c.gpustrat-cache.tmp-{writer.pid}-" + left[1].rsplit("-", 1)[1]], left
    with caplog.at_level(logging.WARNING, logger="gpustrat"):
        assert values(Dataset.range(10).cache(path)) == list(range(10))
    taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(taken) == 1 and repr(lock) in taken[0] and f"process {writer.pid} " in \
        taken[0], caplog.text
    # The dead writer's partial file is gone, the lock released, the cache written.
    assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache"]
    assert values(Dataset.range(5).cache(path)) == list(range(10))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.mark.parametrize("line", ["pid {pid} host {host}\n", "pid {pid}\n"])
def test_a_lock_file_of_a_dead_process_on_this_host_is_taken_over(tmp_path, caplog, line):
    # The second form: a lock file written before lock files named their host.
    path = str(tmp_path / "c")
    pid = dead_pid()
    lock = Path(path + ".gpustrat-cache.lock")
    lock.write_text(line.format(pid=pid, host=socket.gethostname()))
    with caplog.at_level(logging.WARNING, logger="gpustrat"):
        assert values(Dataset.range(4).cache(path)) == [0, 1, 2, 3]
    assert f"process {pid} on this host stopped while writing it" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache"]


def test_a_lock_file_of_another_host_or_a_live_process_is_an_error(tmp_path):
    path = str(tmp_path / "c")
    lock = Path(path + ".gpustrat-cache.lock")
    lock.write_text(f"pid {dead_pid()} host elsewhere.example\n")
    with pytest.raises(FileExistsError, match=r"the lock file '.*c\.gpustrat-cache\.lock' "
                       r"of the cache .* names process \d+ on host 'elsewhere\.example', "
                       r"which may still be writing it.*delete the lock file"):
        values(Dataset.range(4).cache(path))
    # A live process (here: this one's parent) that wrote the lock without holding it.
    lock.write_text(f"pid {os.getppid()} host {socket.gethostname()}\n")
    with pytest.raises(FileExistsError, match=rf"names process {os.getppid()} on host"):
        values(Dataset.range(4).cache(path))
    assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache.lock"]   # left as it was
    lock.unlink()
    assert values(Dataset.range(4).cache(path)) == [0, 1, 2, 3]
