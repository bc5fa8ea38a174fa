"""Fixtures for the variable tests: MirroredStrategy on 2 and 3 logical CPUs."""

import pytest

import gpustrat as gs


@pytest.fixture
def two():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    yield s
    s.close()


@pytest.fixture
def three():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    yield s
    s.close()
