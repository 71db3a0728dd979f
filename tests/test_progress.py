"""The CLI progress bar (recsave/tools/progress.py): drawn only on a terminal, its line ended once."""
import io

import pytest

from recsave.tools.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_nothing_is_drawn_when_the_stream_is_not_a_terminal():
    stream = io.StringIO()
    with Progress("verify", 10, stream=stream) as bar:
        bar.advance(10)
    assert stream.getvalue() == ""


def test_a_terminal_gets_the_bar_and_one_line_end():
    stream = Terminal()
    with Progress("verify", 4_000_000, unit=" MB", scale=1e6, stream=stream) as bar:
        bar.advance(4_000_000)
    bar.close()  # a second close draws nothing more
    text = stream.getvalue()
    assert text.endswith("100.0% 4.0/4.0 MB\n") and text.count("\n") == 1
    assert text.startswith("\rverify [" + "#" * 30 + "]")


def test_an_error_ends_the_line_without_drawing_it_complete():
    stream = Terminal()
    with pytest.raises(OSError):
        with Progress("export", 10, stream=stream) as bar:
            bar.advance(3)
            raise OSError("disk full")
    text = stream.getvalue()
    assert text.endswith("30.0% 3.0/10.0\n") and "100.0%" not in text
