"""recsave.knobs: every knob is checked where it enters (override() or its environment variable),
with an error naming it, instead of failing deep inside a later save."""
from __future__ import annotations

import pytest

from recsave import UsageError, knobs


@pytest.mark.parametrize("name,value", [("segment_bytes", "big"), ("concurrency", 2.5), ("concurrency", True),
                                        ("fsync", 1), ("fsync", "yes"), ("collective_timeout_s", "30"),
                                        ("io_retries", None)])
def test_override_with_a_wrong_type_raises_type_error_naming_the_knob(name, value):
    with pytest.raises(TypeError, match=f"knob '{name}' takes a"):
        with knobs.override(**{name: value}):
            pass


@pytest.mark.parametrize("name,value", [("concurrency", -1), ("concurrency", 0), ("segment_bytes", 0),
                                        ("io_retries", -1), ("collective_timeout_s", 0.0),
                                        ("collective_timeout_s", float("nan"))])
def test_override_out_of_range_raises_usage_error_naming_the_knob(name, value):
    with pytest.raises(UsageError, match=f"knob '{name}' must be >="):
        with knobs.override(**{name: value}):
            pass


@pytest.mark.parametrize("name,value,match", [("segment_bytes", 2 ** 63, "must be <= 2\\*\\*62"),
                                              ("max_header_bytes", 2 ** 64, "must be <= 2\\*\\*62"),
                                              ("writer_lease_s", float("inf"), "must be a finite number")])
def test_override_too_large_raises_usage_error_naming_the_knob(name, value, match):
    """A save with segment_bytes=2**63 committed an index its own validator refused (damaged), and
    max_header_bytes=2**64 overflowed the engine's argument."""
    with pytest.raises(UsageError, match=f"knob '{name}' {match}"):
        with knobs.override(**{name: value}):
            pass


def test_environment_too_large_raises_usage_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("RECSAVE_SEGMENT_BYTES", "9999999999999999999")
    with pytest.raises(UsageError, match="RECSAVE_SEGMENT_BYTES=.*must be <= 2\\*\\*62"):
        knobs.get("segment_bytes")


def test_a_knob_name_of_another_type_is_refused_clearly():
    with pytest.raises(UsageError, match="unknown knob"):
        knobs.get(["segment_bytes"])  # type: ignore[arg-type]


def test_good_overrides_apply_and_unwind():
    before = knobs.get("concurrency")
    with knobs.override(concurrency=3, collective_timeout_s=5, fsync=False):
        assert knobs.get("concurrency") == 3
        assert knobs.get("collective_timeout_s") == 5.0 and isinstance(knobs.get("collective_timeout_s"), float)
        assert knobs.get("fsync") is False
    assert knobs.get("concurrency") == before


@pytest.mark.parametrize("raw,expected", [("1", True), ("TRUE", True), ("yes", True), ("on", True),
                                          ("0", False), ("false", False), ("No", False), ("off", False),
                                          ("", False)])
def test_boolean_environment_values_are_the_documented_ones(monkeypatch, raw, expected):
    monkeypatch.setenv("RECSAVE_WRITER_LOCK", raw)  # (fsync is overridden by the suite's fixture)
    assert knobs.get("writer_lock") is expected


@pytest.mark.parametrize("var,raw,match", [("RECSAVE_WRITER_LOCK", "maybe", "is not a boolean"),
                                           ("RECSAVE_CONCURRENCY", "four", "is not a valid int"),
                                           ("RECSAVE_CONCURRENCY", "-2", "must be >= 1"),
                                           ("RECSAVE_SEGMENT_BYTES", "1.5", "is not a valid int"),
                                           ("RECSAVE_COLLECTIVE_TIMEOUT_S", "nan", "must be >=")])
def test_bad_environment_values_raise_usage_error_naming_the_variable(monkeypatch, var, raw, match):
    monkeypatch.setenv(var, raw)
    name = var[len("RECSAVE_"):].lower()
    with pytest.raises(UsageError, match=match) as exc:
        knobs.get(name)
    assert var in str(exc.value)


def test_unknown_knob_is_refused():
    with pytest.raises(UsageError, match="unknown knob 'segment_size'"):
        with knobs.override(segment_size=1):
            pass


def test_unknown_recsave_variables_are_named_with_the_closest_knob():
    env = {"RECSAVE_FSYNCC": "0", "RECSAVE_DEBUG": "1", "RECSAVE_FSYNC": "0", "RECSAVE_CUDA_ARCHS": "90",
           "RECSAVE_POPULATE": "0", "_RECSAVE_STRESS_KILL": "x", "HOME": "/root"}
    assert knobs.unknown_variables(env) == {"RECSAVE_DEBUG": None, "RECSAVE_FSYNCC": "RECSAVE_FSYNC"}


def test_a_misspelt_variable_is_warned_of_once_at_the_first_knob_read():
    """In a fresh process (the check runs once per process): a RuntimeWarning per unknown name, the
    knobs themselves unaffected, nothing for the variables other parts of recsave read."""
    import os
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('always')\n"
            "from recsave import knobs\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    assert knobs.get('fsync') is False and knobs.get('concurrency') == 4\n"
            "print(len(seen)); [print(w.category.__name__, w.message) for w in seen]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECSAVE_")}
    env.update(RECSAVE_FSYNC="0", RECSAVE_CONCURENCY="8", RECSAVE_BUILD_JOBS="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "1", "RuntimeWarning environment variable RECSAVE_CONCURENCY names no recsave knob and is ignored; "
             "did you mean RECSAVE_CONCURRENCY?"]
