"""format/parsecache.py: parsed indexes remembered by their exact bytes."""
import json

import pytest
import torch
from helpers import read_index_json, write_index_json

import recsave
from recsave.format import index as index_mod
from recsave.format import parsecache
from recsave.format.parsecache import ParseCache


def _big(tag: str) -> bytes:
    return json.dumps({"tag": tag, "pad": "x" * parsecache.MIN_BYTES}).encode()


def test_same_bytes_parse_once_other_bytes_parse_again():
    calls = []

    def parse(raw: bytes):
        calls.append(raw)
        return json.loads(raw)["tag"]

    cache: ParseCache[str] = ParseCache()
    a, b = _big("a"), _big("b")
    assert cache.get(a, parse) == "a" and cache.get(bytes(a), parse) == "a"
    assert cache.get(b, parse) == "b"
    assert len(calls) == 2
    small = b'{"tag": "s"}'
    assert cache.get(small, parse) == "s" and cache.get(small, parse) == "s"
    assert len(calls) == 4  # below MIN_BYTES nothing is remembered


def test_bytes_that_fail_to_parse_are_not_remembered():
    calls = []

    def parse(raw: bytes):
        calls.append(raw)
        raise ValueError("bad")

    cache: ParseCache[str] = ParseCache()
    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get(_big("a"), parse)
    assert len(calls) == 2


def test_held_bytes_stay_under_the_limit(monkeypatch):
    monkeypatch.setattr(parsecache, "MAX_BYTES", 3 * parsecache.MIN_BYTES)
    cache: ParseCache[str] = ParseCache()
    for i in range(10):
        cache.get(_big(str(i)), lambda raw: json.loads(raw)["tag"])
    assert cache._held <= 3 * parsecache.MIN_BYTES + 200 and len(cache._entries) <= 3
    calls = []
    cache.get(_big("9"), lambda raw: calls.append(raw) or "9")
    cache.get(_big("0"), lambda raw: calls.append(raw) or "0")
    assert len(calls) == 1  # the newest is still held, the oldest was dropped


def test_index_read_twice_is_one_record_and_a_changed_index_is_read_anew(tmp_path):
    # four tables: one bucket range each (4097 row starts) takes the index past MIN_BYTES
    model = torch.nn.ModuleDict({f"t{k}": recsave.HashTable(8, name=f"t{k}") for k in range(4)})
    for k, table in enumerate(model.values()):
        table.lookup(torch.arange(20_000) + 10**6 * k, insert=True)
    recsave.Saver(model, output_dir=str(tmp_path)).save("ckpt_1")
    path = tmp_path / "ckpt_1" / "index"
    data = path.read_bytes()
    assert len(data) >= parsecache.MIN_BYTES
    first = index_mod.read(str(tmp_path / "ckpt_1"))
    assert index_mod.read(str(tmp_path / "ckpt_1")) is first
    raw = read_index_json(tmp_path / "ckpt_1")
    raw["created_at"] = "2001-01-01T00:00:00+00:00"
    write_index_json(tmp_path / "ckpt_1", raw)
    again = index_mod.read(str(tmp_path / "ckpt_1"))
    assert again is not first and again.created_at == "2001-01-01T00:00:00+00:00"
    assert again.tensors == first.tensors
