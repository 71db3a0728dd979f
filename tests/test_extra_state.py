"""Registered extras and io states: what the safe loader cannot restore is refused at save, before
anything is written; numpy arrays and scalars are carried as tensors and come back as numpy."""
from __future__ import annotations

import collections
import datetime
import os

import numpy as np
import pytest
import torch

import recsave
from recsave.tools import catalog

torch.set_num_threads(1)


class Holder:
    """A registered extra whose state_dict() is whatever it was given."""

    def __init__(self, state):
        self.state = state
        self.loaded = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


class IoHolder:
    def __init__(self, state):
        self.state = state
        self.loaded = None

    def dump_io_state(self):
        return self.state

    def load_io_state(self, state):
        self.loaded = state


def saver_for(out, model=None):
    model = model or torch.nn.Linear(2, 1)
    return recsave.Saver(model, output_dir=str(out), concurrency=1)


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_numpy_random_state_round_trips(tmp_path):
    rs = np.random.RandomState(7)
    rs.rand(5)
    state = {"np_rng": rs.get_state(), "scale": np.float32(0.25), "n": np.int64(-3), "flag": np.bool_(True),
             "grid": np.arange(6, dtype=np.uint16).reshape(2, 3)[:, ::2], "plain": [1, "a", None]}
    saver = saver_for(tmp_path / "run")
    saver.register_for_checkpointing("rng", Holder(state))
    saver.register_io_state("reader", IoHolder({"pos": np.int32(5), "perm": np.array([3, 1, 2])}))
    path = saver.save("ckpt_1")
    catalog.verify(path)
    fresh = saver_for(tmp_path / "run")
    rng, reader = Holder(None), IoHolder(None)
    fresh.register_for_checkpointing("rng", rng)
    fresh.register_io_state("reader", reader)
    fresh.load()
    assert_same(rng.loaded, state)
    assert_same(reader.loaded, {"pos": np.int32(5), "perm": np.array([3, 1, 2])})
    assert_same(fresh.get_extra_data("rng"), state)
    restored = np.random.RandomState()
    restored.set_state(rng.loaded["np_rng"])
    assert np.array_equal(restored.rand(4), rs.rand(4))


def _nothing_written(out):
    return not os.path.exists(out) or os.listdir(out) in ([], [".recsave.lock"])


@pytest.mark.parametrize("async_save", [False, True])
def test_extra_the_loader_cannot_restore_is_refused_before_writing(tmp_path, async_save):
    out = tmp_path / "run"
    saver = saver_for(out)
    saver.register_for_checkpointing("clock", Holder({"step": 3, "when": [datetime.datetime(2024, 1, 2)]}))
    expected = ("extra 'clock': state_dict() holds a datetime.datetime at ['when'][0], which the safe loader "
                "(torch.load weights_only=True) cannot restore, so the checkpoint could never be loaded; "
                "nothing was saved. Return only tensors, numbers, strings, bytes, None, numpy arrays / "
                "scalars of numeric dtype and dicts / lists / tuples / sets of these (e.g. a datetime "
                "as its isoformat() string), converting back in load_state_dict")
    with pytest.raises(recsave.UsageError) as err:
        saver.async_save("ckpt_1") if async_save else saver.save("ckpt_1")
    assert str(err.value) == expected
    assert _nothing_written(out)
    saver.close()


@pytest.mark.parametrize("value, type_name, where", [
    (collections.namedtuple("Pos", "a b")(1, 2), "test_extra_state.Pos", "['pos']"),
    (np.array(["a", "b"]), "numpy.ndarray of dtype <U1", "['pos']"),
    (frozenset({1}), "frozenset", "['pos']"),
    (np.datetime64("2024-01-01"), "numpy.datetime64 of dtype datetime64[D]", "['pos']"),
    ({"k": collections.defaultdict(int)}, "collections.defaultdict", "['pos']['k']"),
])
def test_io_state_the_loader_cannot_restore_is_refused(tmp_path, value, type_name, where):
    out = tmp_path / "run"
    saver = saver_for(out)
    saver.register_io_state("reader", IoHolder({"pos": value}))
    with pytest.raises(recsave.UsageError, match=r"^io state 'reader': dump_io_state\(\) holds a "
                                                 + __import__("re").escape(f"{type_name} at {where}, ")):
        saver.save("ckpt_1")
    assert _nothing_written(out)


def test_dict_keys_are_checked_too(tmp_path):
    saver = saver_for(tmp_path / "run")
    saver.register_for_checkpointing("odd", Holder({datetime.date(2024, 1, 1): 1}))
    with pytest.raises(recsave.UsageError, match=r"holds a datetime.date at a key of \[\]"):
        saver.save("ckpt_1")
