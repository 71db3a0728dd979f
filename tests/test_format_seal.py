"""The index seal (docs/FORMAT.md section 3, "The seal"): an index's last key holds the CRC32C of
the bytes before it, so damage to the index that still parses and validates is refused by both
readers instead of loading silently."""
import json
import os
import re

import google_crc32c
import pytest
from helpers import make_job, read_index_json, write_index_json

import recsave
from recsave.errors import CorruptCheckpointError
from recsave.format import index as index_mod
from recsave.format import oracle, seal

TAIL = re.compile(rb',"index_crc32c":([0-9]+)}\Z')


@pytest.fixture
def ckpt(tmp_path):
    job = make_job(str(tmp_path / "out"))
    job.train(3)
    return job.saver.save("ckpt_3")


def _index_bytes(ckpt_dir: str) -> bytes:
    with open(os.path.join(ckpt_dir, "index"), "rb") as f:
        return f.read()


def _rewrite(ckpt_dir: str, data: bytes) -> None:
    with open(os.path.join(ckpt_dir, "index"), "wb") as f:
        f.write(data)


def _both_refuse(ckpt_dir: str, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        index_mod.read(ckpt_dir)
    with pytest.raises(CorruptCheckpointError, match=match):
        oracle.read_index(ckpt_dir)


def test_a_saved_index_ends_with_the_crc32c_of_the_bytes_before_its_seal(ckpt):
    data = _index_bytes(ckpt)
    tail = TAIL.search(data)
    assert tail is not None and json.loads(data)[seal.KEY] == int(tail.group(1))
    assert google_crc32c.value(data[:tail.start()]) == int(tail.group(1))  # an independent CRC32C
    assert seal.seal(data[:tail.start()] + b"}") == data


@pytest.mark.parametrize("old,new", [
    (b'"step":3,', b'"step":8,'),  # the restored global step
    (b'"rank":0,"crc32c":', b'"rank":0,"cr-32c":'),  # a dense file's checksum key: it would go unchecked
    (b'"model.pt":{"size":', b'"model.pt":{"size":1'),  # a file read_tensors never opens
    (b'"io_state_count":{', b'"io_state_-ount":{'),  # a listed file nothing reads
])
def test_edits_that_still_validate_are_refused_by_both_readers_and_every_load(ckpt, old, new):
    data = _index_bytes(ckpt)
    assert old in data
    _rewrite(ckpt, data.replace(old, new, 1))
    _both_refuse(ckpt, f'bytes have CRC32C [0-9]+, (but it records|not the [0-9]+ its "{seal.KEY}" records)')
    with pytest.raises(CorruptCheckpointError, match=seal.KEY):
        recsave.format.read_tensors(ckpt)


def test_an_unknown_key_in_a_chunk_is_refused(ckpt):
    data = _index_bytes(ckpt)
    edited = re.sub(rb'("rows":\[0,[0-9]+\])', rb'\1,"zz":1', data, count=1)
    assert edited != data
    _rewrite(ckpt, edited)
    _both_refuse(ckpt, "CRC32C")


@pytest.mark.parametrize("how", ["space after", "newline after", "key not last", "bool", "too big", "negative"])
def test_a_seal_written_otherwise_is_corrupt(ckpt, how):
    raw = read_index_json(ckpt)
    body = json.dumps(raw, separators=(",", ":")).encode()
    good = seal.seal(body)
    crc = json.loads(good)[seal.KEY]
    data = {
        "space after": good + b" ",
        "newline after": good + b"\n",
        "key not last": body[:1] + b'"%s":%d,' % (seal.KEY.encode(), crc) + body[1:],
        "bool": body[:-1] + b',"%s":true}' % seal.KEY.encode(),
        "too big": body[:-1] + b',"%s":%d}' % (seal.KEY.encode(), 1 << 32),
        "negative": body[:-1] + b',"%s":-1}' % seal.KEY.encode(),
    }[how]
    _rewrite(ckpt, data)
    _both_refuse(ckpt, seal.KEY)


def test_an_index_without_a_seal_is_read_as_before(ckpt):
    """Indexes written before seals have none: both readers accept them, and a load is unchanged."""
    want = recsave.format.read_tensors(ckpt)
    write_index_json(ckpt, read_index_json(ckpt), sealed=False, indent=1)  # other bytes
    assert not TAIL.search(_index_bytes(ckpt))
    assert index_mod.read(ckpt).step == 3 and oracle.read_index(ckpt)["step"] == 3
    got = recsave.format.read_tensors(ckpt)
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)


def test_an_edit_resealed_is_read(ckpt):
    raw = read_index_json(ckpt)
    raw["step"] = 9
    write_index_json(ckpt, raw)
    assert index_mod.read(ckpt).step == 9 and oracle.read_index(ckpt)["step"] == 9


@pytest.mark.parametrize("body", [b"{}", b"{ }", b"[1]", b""])
def test_seal_needs_a_json_object_with_keys(body):
    with pytest.raises(ValueError, match="non-empty JSON object"):
        seal.seal(body)


# Behind the seal (and the only defence of an index written before seals): entries hold only
# the keys recsave writes, and a dense file must have its CRC32C.
@pytest.mark.parametrize("where", ["file entry", "chunk"])
def test_an_unknown_key_in_an_entry_is_corrupt_even_unsealed(ckpt, where):
    raw = read_index_json(ckpt)
    if where == "file entry":
        entry = raw["files"]["model.pt"]
        entry["cr-32c"] = entry.pop("crc32c")  # renamed: model.pt would be read unchecked
        match = r"unknown keys \['cr-32c'\]"
    else:
        raw["tensors"]["user@embedding"]["chunks"][0]["zz"] = 1
        match = r"unknown keys \['zz'\]"
    write_index_json(ckpt, raw, sealed=False, indent=1)  # as an older recsave wrote it
    _both_refuse(ckpt, match)


def test_a_dense_file_listed_without_crc32c_is_refused_when_read(ckpt, tmp_path):
    raw = read_index_json(ckpt)
    del raw["files"]["model.pt"]["crc32c"]
    write_index_json(ckpt, raw)
    assert recsave.format.read_tensors(ckpt)  # read_tensors does not open model.pt
    job = make_job(str(tmp_path / "other"))
    with pytest.raises(CorruptCheckpointError, match="model.pt: the index records no crc32c"):
        job.saver.load(ckpt)


def test_intact_tells_from_the_bytes_alone():
    body = b'{"magic":"recsave.index","format_version":4,"step":3}'
    sealed = seal.seal(body)
    assert seal.intact(sealed) is True
    assert seal.intact(sealed.replace(b'"step":3', b'"step":4')) is False  # an edit under the seal
    digits = sealed[sealed.rindex(b":") + 1:-1]
    assert seal.intact(sealed.replace(digits, str(int(digits) ^ 1).encode())) is False
    assert seal.intact(body) is None  # unsealed: only a parse tells
    padded = sealed[:-1 - len(digits)] + b"0" + digits + b"}"  # a byte inserted: not as seal() writes
    assert seal.intact(padded) is None
    assert seal.intact(sealed[:-1]) is None and seal.intact(b"") is None


def test_rotation_decides_without_parsing_the_indexes_it_prunes(tmp_path, monkeypatch):
    """Rotation and gc read what they need (a seal, a version prefix, a parent id the writer
    remembers) instead of validating every pruned index: at a thousand ranks one parse costs
    seconds. A pruned index that fails its seal is still parsed, found damaged and kept."""
    out = str(tmp_path / "run")
    job = make_job(out, max_keep=2)
    for step in (1, 2, 3):
        job.train(1)
        job.saver.save(f"ckpt_{step}")
    parsed = []
    real = index_mod._parse  # counting the validating parses
    monkeypatch.setattr(index_mod, "_parse", lambda data, path: parsed.append(path) or real(data, path))
    job.train(1)
    job.saver.save("ckpt_4")  # prunes ckpt_2
    assert parsed == [] and sorted(n for n in os.listdir(out) if n.startswith("ckpt")) == ["ckpt_3", "ckpt_4"]

    path = os.path.join(out, "ckpt_3", "index")
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(b'"step":3,') == 1
    with open(path, "wb") as f:  # damaged after it was written: the seal no longer matches
        f.write(data.replace(b'"step":3,', b'"step":9,'))
    job.train(1)
    job.saver.save("ckpt_5")
    assert os.path.isdir(os.path.join(out, "ckpt_3"))  # damaged: never deleted
    assert any(p.endswith(os.path.join("ckpt_3", "index")) for p in parsed)
    job.saver.close()
