"""The TFRecord CRC32C: C through google-crc32c (a dependency), else pure Python with one
warning per process."""

from __future__ import annotations

import configparser
import sys
import types
import warnings
from pathlib import Path

import pytest

from gpustrat.data import tfrecord

REPO = Path(__file__).resolve().parents[2]
VECTORS = {b"123456789": 0xE3069283, bytes(32): 0x8A9136AA, b"": 0}


@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget the probed CRC function, so that the next call probes again."""
    monkeypatch.setattr(tfrecord, "_probed", False)
    monkeypatch.setattr(tfrecord, "_fast", None)
    return monkeypatch


def test_google_crc32c_is_a_dependency():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = [r.split("#")[0].strip() for r in cfg["options"]["install_requires"].splitlines()]
    assert any(r.startswith("google-crc32c") for r in requires), requires


def test_c_crc_is_used_without_a_warning(fresh_probe):
    pytest.importorskip("google_crc32c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data, crc in VECTORS.items():
            assert tfrecord.crc32c(data) == crc
    assert tfrecord._fast is not None


def test_pure_python_fallback_warns_once_and_stays_correct(fresh_probe):
    fresh_probe.setitem(sys.modules, "google_crc32c", None)   # import raises ImportError
    fresh_probe.setitem(sys.modules, "crc32c", None)
    with pytest.warns(RuntimeWarning, match="pip install google-crc32c") as record:
        assert tfrecord.crc32c(b"123456789") == 0xE3069283
    assert len(record) == 1 and "10 MB/s" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a second warning would raise
        for data, crc in VECTORS.items():
            assert tfrecord.crc32c(data) == crc


def test_google_crc32c_without_its_c_extension_counts_as_the_fallback(fresh_probe):
    slow = types.SimpleNamespace(implementation="python", value=lambda data: 0)
    fresh_probe.setitem(sys.modules, "google_crc32c", slow)
    fresh_probe.setitem(sys.modules, "crc32c", None)
    with pytest.warns(RuntimeWarning, match="C extension"):
        assert tfrecord.crc32c(b"123456789") == 0xE3069283


def test_writing_and_reading_warn_once_through_the_fallback(fresh_probe, tmp_path):
    fresh_probe.setitem(sys.modules, "google_crc32c", None)
    fresh_probe.setitem(sys.modules, "crc32c", None)
    from gpustrat.data import TFRecordDataset, TFRecordWriter
    path = tmp_path / "a.tfrecord"
    with pytest.warns(RuntimeWarning) as record:
        with TFRecordWriter(path) as w:
            for i in range(3):
                w.write(f"r{i}")
        got = [bytes(r) for r in TFRecordDataset(str(path))]
    assert got == [b"r0", b"r1", b"r2"]
    assert sum(issubclass(r.category, RuntimeWarning) for r in record) == 1
