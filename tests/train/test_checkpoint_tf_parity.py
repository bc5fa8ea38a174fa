"""Deferred restores and ``CheckpointManager`` schedules against what TensorFlow 2.21
did with the same program (``record_tf_checkpoints.py``; TensorFlow is not needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_tf_checkpoints as programs  # noqa: E402
from tf_recorded_checkpoints import TF_2_21  # noqa: E402


@pytest.mark.parametrize("name", ["deferred", "hours", "interval"])
def test_matches_tensorflow(tmp_path, name):
    fn = {"deferred": programs.deferred, "hours": programs.manager_hours,
          "interval": programs.manager_interval}[name]
    assert fn(str(tmp_path)) == TF_2_21[name]
