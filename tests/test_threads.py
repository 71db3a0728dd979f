"""recsave/threads.py: work on a plain thread (start) or here and now (run_here), as Futures."""
import threading

import pytest

from recsave import threads


def test_start_runs_on_a_named_thread_and_hands_over_errors():
    names = []
    ok = threads.start(lambda x: names.append(threading.current_thread().name) or x * 2, 21, name="recsave-test")
    assert ok.result(10) == 42 and names == ["recsave-test"]
    bad = threads.start(lambda: 1 // 0, name="recsave-test")
    with pytest.raises(ZeroDivisionError):
        bad.result(10)


def test_run_here_runs_now_and_keeps_errors_in_the_future():
    calls = []
    done = threads.run_here(lambda x: calls.append(threading.current_thread()) or x + 1, 1)
    assert done.done() and done.result() == 2 and calls == [threading.current_thread()]
    bad = threads.run_here(lambda: 1 // 0)
    assert bad.done()
    with pytest.raises(ZeroDivisionError):
        bad.result()


def test_run_here_raises_an_interrupt_at_once():
    """A Ctrl-C inside inline work is not parked in the Future until someone asks for the result."""
    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        threads.run_here(interrupted)
