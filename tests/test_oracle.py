"""The pure-Python oracle reader (recsave.format.oracle) against files built without recsave's writer:
safetensors' own ``save_file`` output wrapped in a hand-built index, and hand-built checkpoints holding
every dtype of FORMAT.md section 4; and format_version 2 indexes (delta, section 10; int8 serving,
section 8) written by recsave, read like the engine reads them."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import struct
from pathlib import Path
from typing import Dict

import google_crc32c
import pytest
import torch
from helpers import read_index_json, write_index_json
from safetensors import safe_open
from safetensors.torch import save_file

import recsave.errors as E
from recsave.format import oracle

CORPUS = Path(__file__).resolve().parent / "corpus"
_spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def copy_valid(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(CORPUS / "valid_basic", d)
    return d


def edit(d: Path, fn) -> None:
    """Applies fn to the index of d and writes it back sealed (if it was), so the edit itself is
    what the readers judge."""
    sealed = b'"index_crc32c":' in (d / "index").read_bytes()
    idx = read_index_json(d)
    fn(idx)
    write_index_json(d, idx, sealed=sealed)


def test_crc32c_check_value() -> None:
    assert google_crc32c.value(b"123456789") == 0xE3069283


ORACLE_MODULES = ["recsave/format/oracle.py", "recsave/format/pycrc32c.py"]
PACKAGE_DEPENDENCIES = {"torch", "numpy", "fsspec", "pyarrow", "recsave"}  # setup.cfg install_requires


@pytest.mark.parametrize("module", ORACLE_MODULES)
def test_oracle_imports_only_the_package_dependencies(module: str) -> None:
    import ast
    import sys

    tree = ast.parse((Path(__file__).resolve().parents[1] / module).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    outside = sorted(imported - PACKAGE_DEPENDENCIES - set(sys.stdlib_module_names) - {"__future__"})
    assert outside == [], f"{module} imports {outside}, which recsave does not depend on"


def test_oracle_works_without_the_test_extras(tmp_path: Path) -> None:
    """google_crc32c (a test extra) made unimportable: the oracle still imports and verifies."""
    import subprocess
    import sys

    d = copy_valid(tmp_path)
    code = ("import sys; sys.modules['google_crc32c'] = None\n"
            "from recsave.format import oracle\n"
            f"print(sorted(oracle.read_tensors({str(d)!r}, verify=True)))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(sorted(oracle.read_tensors(str(d), verify=True)))


def test_pure_crc32c_check_value_and_engine_agreement() -> None:
    from recsave import _C
    from recsave.format.pycrc32c import crc32c

    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA and crc32c(b"\xff" * 32) == 0x62A8AB43
    rng = random.Random(5)
    blob = bytes(rng.getrandbits(8) for _ in range(300_000))
    for length in (1, 3, 255, 4095, 4096, 4097, 8192 * 3 + 17, 65_536, 300_000):
        start = rng.randrange(0, 64)
        piece = blob[start:start + length]
        assert crc32c(piece) == _C.crc32c(piece), length
        assert crc32c(memoryview(piece)) == crc32c(bytearray(piece)) == crc32c(piece)
    # Extending a CRC equals the CRC of the concatenation, as with the engine.
    assert crc32c(blob[1000:], crc32c(blob[:1000])) == _C.crc32c(blob)


def index_for_safetensors(d: Path, split: Dict[str, list], dtypes: Dict[str, str]) -> None:
    """Writes an index over safetensors files in ``d``: ``split`` maps a tensor name to its list of
    (file, rows or None); chunk offsets and lengths come from each file's header, parsed by hand."""
    files, tensors = {}, {}
    for name, parts in split.items():
        chunks, shape0, tail = [], 0, None
        for fname, rows in parts:
            blob = (d / fname).read_bytes()
            (n,) = struct.unpack("<Q", blob[:8])
            e = json.loads(blob[8:8 + n])[name]
            files[fname] = {"size": len(blob), "rank": 0}
            off, length = 8 + n + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0]
            c = {"file": fname, "offset": off, "length": length,
                 **mc.seg_fields(blob[off:off + length], ("bytes", 7))}
            if rows is not None:
                c["rows"] = [shape0, shape0 + rows]
                shape0 += rows
                tail = [] if mc.DTYPES[dtypes[name]][1] is None else e["shape"][1:]  # U8 [nbytes] otherwise
            chunks.append(c)
        shape = [] if parts[0][1] is None else [shape0] + (tail or [])
        tensors[name] = {"dtype": dtypes[name], "shape": shape, "chunks": chunks}
    (d / "index").write_text(json.dumps({
        "magic": "recsave.index", "format_version": 1, "recsave_version": "x", "created_at": "2024-01-01T00:00:00Z",
        "step": None, "world_size": 1, "partition": None, "files": files, "tensors": tensors, "meta": {}}))


def test_reads_safetensors_save_file_output(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(7, 3, generator=g)
    scalar = torch.tensor(-3, dtype=torch.int64)
    half = torch.randn(5, generator=g).to(torch.bfloat16)
    f8 = torch.randn(2, 2, generator=g).to(torch.float8_e4m3fn)
    cplx = torch.randn(3, dtype=torch.complex128, generator=g)
    meta = {"format": "recsave.shard", "format_version": "1"}
    save_file({"emb": emb[:4], "scalar": scalar, "half": half, "f8": f8}, str(tmp_path / "sparse-0-0.safetensors"),
              metadata=meta)
    save_file({"emb": emb[4:], "cplx": cplx.view(torch.uint8).reshape(-1).clone()},
              str(tmp_path / "sparse-0-1.safetensors"), metadata={**meta, "recsave.dtypes": '{"cplx": "complex128"}'})
    a, b = "sparse-0-0.safetensors", "sparse-0-1.safetensors"
    index_for_safetensors(tmp_path, {"emb": [(a, 4), (b, 3)], "scalar": [(a, None)], "half": [(a, 5)],
                                     "f8": [(a, 2)], "cplx": [(b, 3)]},
                          {"emb": "float32", "scalar": "int64", "half": "bfloat16", "f8": "float8_e4m3fn",
                           "cplx": "complex128"})
    got = oracle.read_tensors(str(tmp_path))
    for name, want in {"emb": emb, "scalar": scalar, "half": half, "f8": f8, "cplx": cplx}.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert raw(got[name]) == raw(want), name
    header = oracle.read_shard_header(str(tmp_path / b))
    assert header["__metadata__"]["recsave.dtypes"] == '{"cplx": "complex128"}'
    assert header["cplx"]["dtype"] == "U8" and header["cplx"]["shape"] == [48]


def test_hand_built_files_open_in_safetensors() -> None:
    """The other direction: safetensors itself opens the corpus' hand-built shard files."""
    ref = json.loads((CORPUS / "cases.json").read_text())["valid_basic"]["tensors"]
    parts: Dict[str, bytes] = {}
    for fname in ("sparse-0-0.safetensors", "sparse-1-0.safetensors"):  # in row order
        with safe_open(str(CORPUS / "valid_basic" / fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                code = mc.DTYPES[ref[name]["dtype"]][1]
                assert t.dtype == (getattr(torch, ref[name]["dtype"]) if code else torch.uint8), name
                parts[name] = parts.get(name, b"") + raw(t)
    assert parts == {name: bytes.fromhex(r["hex"]) for name, r in ref.items()}


@pytest.mark.parametrize("dtype", sorted(mc.DTYPES))
def test_every_dtype_round_trips(dtype: str, tmp_path: Path) -> None:
    itemsize = mc.DTYPES[dtype][0]
    rng = random.Random(dtype)
    rand = (lambda n: bytes(rng.randrange(2) for _ in range(n))) if dtype == "bool" else rng.randbytes
    specs = [
        {"name": "m", "dtype": dtype, "shape": [5, 3], "data": rand(15 * itemsize),
         "parts": [("sparse-0-0.safetensors", 3, ("bytes", 5)), ("sparse-1-0.safetensors", 0, ("ends", [0])),
                   ("sparse-1-1.safetensors", 2, ("ends", [1, 6 * itemsize]))]},
        {"name": "s", "dtype": dtype, "shape": [], "data": rand(itemsize), "parts": [("sparse-0-0.safetensors", None,
                                                                                     ("bytes", 1))]},
        {"name": "e", "dtype": dtype, "shape": [0, 4], "data": b"", "parts": [("sparse-1-0.safetensors", 0,
                                                                                ("bytes", 8))]},
        {"name": "z", "dtype": dtype, "shape": [2, 0, 3], "data": b"", "parts": [("sparse-1-1.safetensors", 2,
                                                                                   ("ends", [0]))]},
    ]
    mc.write_checkpoint(tmp_path, specs)
    got = oracle.read_tensors(str(tmp_path))
    for s in specs:
        t = got[s["name"]]
        assert t.dtype == getattr(torch, dtype) and list(t.shape) == s["shape"] and raw(t) == s["data"]
    assert list(oracle.read_tensors(str(tmp_path), ["s"])) == ["s"]


def test_values_not_just_bytes(tmp_path: Path) -> None:
    got = oracle.read_tensors(str(copy_valid(tmp_path)))
    assert got["emb"].tolist() == [[float(3 * r + c - 7) for c in range(3)] for r in range(5)]
    assert got["step"].item() == -123456789012 and got["step"].dim() == 0
    big = struct.unpack("<f", b"\0\0" + struct.pack("<f", 1e30)[2:])[0]  # the corpus truncates to bfloat16
    assert got["half"].tolist() == [1.0, -2.0, 0.5, big]
    assert got["c"].tolist() == [complex(1, -1), complex(2.5, 0)]
    assert got["mask"].tolist() == [True, False, True]
    assert got["f8"].float().tolist() == [[1.0, -1.0], [2.0, 0.0]]


def test_names_subset_and_missing_name(tmp_path: Path) -> None:
    d = str(copy_valid(tmp_path))
    assert sorted(oracle.read_tensors(d, ["emb", "c"])) == ["c", "emb"]
    assert list(oracle.read_tensors(d, "step")) == ["step"]
    with pytest.raises(E.ConfigError, match="nope") as info:
        oracle.read_tensors(d, ["emb", "nope"])
    assert info.value.key == "nope"


def test_verify_false_skips_checksums(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(CORPUS / "crc_flipped_byte", d)
    with pytest.raises(E.CorruptCheckpointError, match="crc32c") as info:
        oracle.read_tensors(str(d))
    assert info.value.key == "t" and info.value.path.endswith("sparse-0-0.safetensors")
    assert oracle.read_tensors(str(d), verify=False)["t"].shape == (4, 2)


def test_read_index_ignores_unknown_top_level_keys(tmp_path: Path) -> None:
    d = copy_valid(tmp_path)
    edit(d, lambda i: i.update(future_key={"anything": [1, 2]}))
    idx = oracle.read_index(str(d))
    assert idx["world_size"] == 2 and set(idx["tensors"]) == {"emb", "step", "empty", "mask", "ids", "half", "c",
                                                              "f8", "zero_d_cplx"}


@pytest.mark.parametrize("version", ["1", 1.0, True, None, 0, -1, 2**70])
def test_unknown_format_versions(version, tmp_path: Path) -> None:
    """A version below 1 is no writer's: damage (docs/FORMAT.md section 3), not a newer index."""
    d = copy_valid(tmp_path)
    edit(d, lambda i: i.update(format_version=version))
    below = isinstance(version, int) and not isinstance(version, bool) and version < 1
    with pytest.raises(E.CorruptCheckpointError if below else E.FormatVersionError, match="format_version"):
        oracle.read_index(str(d))


@pytest.mark.parametrize("bad", [".", "..", "", "a b", "x/y", "\\evil", "sparse\x00.safetensors"])
def test_file_names_must_be_plain(bad: str, tmp_path: Path) -> None:
    d = copy_valid(tmp_path)

    def rename(i: dict) -> None:
        i["files"][bad] = i["files"].pop("sparse-1-0.safetensors")
        for t in i["tensors"].values():
            for c in t["chunks"]:
                c["file"] = bad if c["file"] == "sparse-1-0.safetensors" else c["file"]
    edit(d, rename)
    with pytest.raises(E.CorruptCheckpointError, match="plain file name"):
        oracle.read_index(str(d))


def test_duplicate_json_keys_are_refused(tmp_path: Path) -> None:
    d = copy_valid(tmp_path)
    text = (d / "index").read_text()
    (d / "index").write_text(text.replace('"step": 7', '"step": 7, "step": 8'))
    with pytest.raises(E.CorruptCheckpointError, match="duplicate"):
        oracle.read_index(str(d))


def test_index_and_listed_file_must_be_regular_files(tmp_path: Path) -> None:
    d = copy_valid(tmp_path)
    os.unlink(d / "sparse-1-0.safetensors")
    os.mkdir(d / "sparse-1-0.safetensors")
    with pytest.raises(E.CorruptCheckpointError, match="regular file"):
        oracle.read_tensors(str(d))
    os.rmdir(d / "sparse-1-0.safetensors")
    os.mkfifo(d / "sparse-1-0.safetensors")  # would block a reader that opens it blindly
    with pytest.raises(E.CorruptCheckpointError, match="regular file"):
        oracle.read_tensors(str(d))
    os.unlink(d / "index")
    os.mkdir(d / "index")
    with pytest.raises(E.CorruptCheckpointError, match="index"):
        oracle.read_index(str(d))
    with pytest.raises(E.CheckpointNotFoundError):
        oracle.read_index(str(tmp_path / "does-not-exist"))


def test_whole_file_crc32c_is_verified_when_present(tmp_path: Path) -> None:
    d = copy_valid(tmp_path)
    whole = google_crc32c.value((d / "sparse-1-0.safetensors").read_bytes())
    edit(d, lambda i: i["files"]["sparse-1-0.safetensors"].update(crc32c=whole))
    oracle.read_tensors(str(d))
    edit(d, lambda i: i["files"]["sparse-1-0.safetensors"].update(crc32c=whole ^ 1))
    with pytest.raises(E.CorruptCheckpointError, match="crc32c"):
        oracle.read_tensors(str(d))


@pytest.mark.parametrize("dtypes", ['{"c": ["complex128"]}', '{"__metadata__": "complex128"}', "not json", "[1]",
                                    '{"c": "complex64"}', '{"c": "float33"}', '{"nope": "complex128"}',
                                    '{"c": "bits16"}'])
def test_hostile_recsave_dtypes_metadata(dtypes: str, tmp_path: Path) -> None:
    """A shard whose recsave.dtypes metadata is malformed or names the wrong dtype is refused."""
    blob, offs = mc.shard_bytes([("c", "U8", [32], bytes(range(32)))], header_override=json.dumps(
        {"__metadata__": {"recsave.dtypes": dtypes}, "c": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]}}
    ).encode())
    (tmp_path / "s.safetensors").write_bytes(blob)
    index_for_safetensors(tmp_path, {"c": [("s.safetensors", 2)]}, {"c": "complex128"})
    with pytest.raises(E.CorruptCheckpointError):
        oracle.read_tensors(str(tmp_path))


def test_random_damage_raises_only_recsave_errors(tmp_path: Path) -> None:
    """Byte flips, insertions and truncations anywhere in the valid checkpoint: the oracle either reads
    it or raises a recsave error; nothing else (KeyError, TypeError, struct.error, ...) escapes."""
    rng = random.Random(1234)
    src = CORPUS / "valid_basic"
    names = sorted(p.name for p in src.iterdir())
    outcomes = set()
    for it in range(400):
        d = tmp_path / f"c{it}"
        shutil.copytree(src, d)
        target = d / rng.choice(names)
        b = bytearray(target.read_bytes())
        op = rng.randrange(4)
        pos = rng.randrange(len(b))
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos] = rng.choice(b'{}[]",:0123456789-.eE \x00\xff')
        elif op == 2:
            del b[pos:]
        else:
            b[pos:pos] = rng.randbytes(rng.randrange(1, 4))
        target.write_bytes(bytes(b))
        try:
            oracle.read_tensors(str(d))
            outcomes.add("ok")
        except E.RecsaveError as e:
            # A flipped digit of a format_version reads as another (e.g. newer) version.
            assert isinstance(e, (E.CorruptCheckpointError, E.CheckpointNotFoundError, E.FormatVersionError)), \
                repr(e)
            outcomes.add(type(e).__name__)
        shutil.rmtree(d)
    assert "CorruptCheckpointError" in outcomes


# ------------------------------------------------- format_version 2: delta and serving indexes
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from recsave.tables.hashtable import HashTable

        self.user = HashTable(8, name="user", seed=3)
        self.lin = torch.nn.Linear(2, 2)


@pytest.fixture
def chain_dir(tmp_path: Path):
    """<out>/ckpt_1 (full, 200 rows) and <out>/ckpt_2, a delta of it: 10 rows rewritten, 5 ids
    inserted, 4 deleted. Returns (out, rewritten + inserted ids, deleted ids)."""
    from recsave import Saver

    net, out = _Net(), str(tmp_path / "out")
    ids = torch.arange(200, dtype=torch.int64) * 17 + 3
    net.user.load_rows(ids, torch.randn(200, 8, generator=torch.Generator().manual_seed(1)))
    saver = Saver(net, output_dir=out, max_keep=None)
    saver.save("ckpt_1", incremental=True)
    changed = torch.cat([ids[20:30], torch.arange(5, dtype=torch.int64) - 50])
    net.user.load_rows(changed, torch.full((15, 8), 0.5), clear=False)
    deleted = ids[100:104]
    assert net.user.delete(deleted) == 4
    saver.save("ckpt_2", incremental=True)
    assert saver.last_save_kind == "delta"
    saver.close()
    return Path(out), changed, deleted


def engine_tensors(ckpt: str) -> Dict[str, torch.Tensor]:
    from recsave.format import read_tensors

    return read_tensors(ckpt, names=None, verify=True)


def test_reads_a_delta_as_stored_like_the_engine(chain_dir) -> None:
    out, changed, deleted = chain_dir
    d = str(out / "ckpt_2")
    idx = oracle.read_index(d)
    assert (idx["format_version"], idx["kind"], idx["parent"]["id"], idx["base"]) == (4, "delta", "ckpt_1", "ckpt_1")
    got, want = oracle.read_tensors(d), engine_tensors(d)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and raw(got[name]) == raw(t), name
    # The delta's own rows and tombstones, not the chain's merged state.
    assert sorted(got["user@id"].reshape(-1).tolist()) == sorted(changed.tolist())
    assert got["user@tombstone"].dtype == torch.int64 and got["user@tombstone"].dim() == 1
    assert sorted(got["user@tombstone"].tolist()) == sorted(deleted.tolist())
    assert oracle.check_parent(d) == str(out / "ckpt_1")
    assert oracle.check_parent(str(out / "ckpt_1")) is None  # a full checkpoint has no parent


def test_check_parent_refuses_a_rewritten_or_missing_parent(chain_dir) -> None:
    out, _, _ = chain_dir
    d = str(out / "ckpt_2")
    index = read_index_json(out / "ckpt_1")
    write_index_json(out / "ckpt_1", dict(index, created_at="2000-01-01T00:00:00Z"))  # valid, other bytes
    oracle.read_index(str(out / "ckpt_1"))
    with pytest.raises(E.CorruptCheckpointError, match="rewritten or damaged") as info:
        oracle.check_parent(d)
    assert info.value.path == str(out / "ckpt_1" / "index")
    shutil.rmtree(out / "ckpt_1")
    with pytest.raises(E.CheckpointNotFoundError, match="parent"):
        oracle.check_parent(d)


def _set(path: str, value):
    """An edit of the index JSON: sets the value at a '/'-separated key path (None: deletes it)."""
    def apply(i: dict) -> None:
        *keys, last = path.split("/")
        for k in keys:
            i = i[k]
        if value is None:
            del i[last]
        else:
            i[last] = value
    return apply


@pytest.mark.parametrize("change, error, match", [
    (_set("format_version", 1), E.CorruptCheckpointError, "format_version"),
    (_set("format_version", 2), E.CorruptCheckpointError, "crc32c"),  # version 2 holds CRC lists, ranges inline
    (_set("format_version", 3), E.CorruptCheckpointError, "bucket_segments"),
    (_set("format_version", 5), E.FormatVersionError, "format_version"),
    (_set("kind", "sketch"), E.FormatVersionError, "kind 'sketch'"),
    (_set("kind", 2), E.CorruptCheckpointError, "kind"),
    (_set("parent", None), E.CorruptCheckpointError, "parent"),
    (_set("parent/crc32c", -1), E.CorruptCheckpointError, "crc32c"),
    (_set("parent/id", "../x"), E.CorruptCheckpointError, "parent"),
    (_set("base", None), E.CorruptCheckpointError, "base"),
    (_set("meta/tables/user/tombstones", 5), E.CorruptCheckpointError, "tombstone"),
    (_set("meta/tables/user/cleared", None), E.CorruptCheckpointError, "cleared"),
    (_set("tensors/user@tombstone", None), E.CorruptCheckpointError, "user@tombstone"),
])
def test_delta_index_rules_agree_with_the_engine(chain_dir, change, error, match) -> None:
    from recsave.format import index as index_mod

    out, _, _ = chain_dir
    d = out / "ckpt_2"
    edit(d, change)
    with pytest.raises(error, match=match):
        oracle.read_index(str(d))
    with pytest.raises(error):
        index_mod.read(str(d))


def test_other_kinds_must_not_have_parent_or_base(chain_dir) -> None:
    out, _, _ = chain_dir
    d = out / "ckpt_1"
    edit(d, lambda i: i.update(base="ckpt_1"))
    with pytest.raises(E.CorruptCheckpointError, match="must not have 'parent' or 'base'"):
        oracle.read_index(str(d))
    edit(d, lambda i: (i.pop("base"), i.update(format_version=2)))
    with pytest.raises(E.FormatVersionError, match="version 2"):  # a full index is version 1 or 3
        oracle.read_index(str(d))


@pytest.fixture
def serving_dir(tmp_path: Path):
    """An int8 serving export (float16 scales) of a saved _Net, and the net."""
    import recsave

    net = _Net()
    ids = torch.arange(300, dtype=torch.int64) * 7 - 40
    rows = torch.randn(300, 8, generator=torch.Generator().manual_seed(2)) * 3
    rows[0] = 0.25  # a constant row
    net.user.load_rows(ids, rows)
    saver = recsave.Saver(net, output_dir=str(tmp_path / "src"))
    ckpt = saver.save("ckpt_5")
    saver.close()
    return recsave.export_serving(ckpt, str(tmp_path / "serve"), "int8"), net


def test_reads_an_int8_serving_checkpoint_and_decodes_it_as_recsave_loads_it(serving_dir) -> None:
    from recsave import Saver

    d, net = serving_dir
    idx = oracle.read_index(d)
    assert (idx["format_version"], idx["kind"], idx["meta"]["tables"]["user"]["quant"]) == (4, "serving", "int8")
    got, want = oracle.read_tensors(d), engine_tensors(d)
    assert sorted(got) == sorted(want) and {"user@scale", "user@offset"} <= set(got)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and raw(got[name]) == raw(t), name
    assert got["user@embedding"].dtype == torch.int8 and got["user@scale"].dtype == torch.float16
    decoded = oracle.dequantize_int8(got["user@embedding"], got["user@scale"], got["user@offset"])
    ids = got["user@id"].reshape(-1)
    constant = int((ids == -40).nonzero())  # rows are in bucket order
    assert torch.equal(decoded[constant], torch.full((8,), 0.25))  # a constant row is exact
    loaded = _Net()
    Saver(loaded, output_dir=d).load(d, direct_path=True)
    _, values, _ = loaded.user.export(ids)
    assert raw(values) == raw(decoded)  # recsave's load decodes bit for bit as the spec says
    _, orig, _ = net.user.export(ids)
    span = (orig.max(1).values - orig.min(1).values).unsqueeze(1)
    assert bool(((decoded - orig).abs() <= span / 510 + 1e-2 * span + 1e-6).all())


@pytest.mark.parametrize("change, error, match", [
    (_set("meta/tables/user/quant", "int4"), E.FormatVersionError, "'int4'"),
    (_set("tensors/user@scale/dtype", "bfloat16"), E.CorruptCheckpointError, "scale"),
    (_set("meta/tables/user/dim", 9), E.CorruptCheckpointError, "int8"),
    (_set("tensors/user@offset", None), E.CorruptCheckpointError, "user@offset"),
    # a full index of version 2
    (lambda i: (i.pop("kind"), i.update(format_version=2)), E.FormatVersionError, "version 2"),
    (_set("parent", {"id": "x", "crc32c": 0}), E.CorruptCheckpointError, "parent"),
])
def test_serving_index_rules_agree_with_the_engine(serving_dir, change, error, match) -> None:
    from recsave.format import index as index_mod

    d = Path(serving_dir[0])
    edit(d, change)
    with pytest.raises(error, match=match):
        oracle.read_index(str(d))
    with pytest.raises(error):
        index_mod.read(str(d))
