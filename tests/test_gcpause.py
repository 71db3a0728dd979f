"""recsave.gcpause.paused: the cyclic collector is off inside, back on after (also after an error
and after nested pauses), and stays off when it was off before."""
import gc

import pytest

from recsave import gcpause


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_nests_and_restores():
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still runs
    assert gc.isenabled()


def test_restored_after_an_error():
    with pytest.raises(ValueError):
        with gcpause.paused():
            raise ValueError("boom")
    assert gc.isenabled()


def test_left_off_when_it_was_off():
    gc.disable()
    with gcpause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
