#!/usr/bin/env python3
"""(Re)generates the corpus of small recsave checkpoints under tests/corpus/<case>/ and cases.json.

Every file is built by hand from docs/FORMAT.md with struct and json (never with recsave's writer), so
the corpus tests the readers against the spec rather than against recsave's own idea of it. One case is
valid (``valid_basic``; ``valid_v3`` and ``valid_v4``, the same as format_version 3 and 4; ``valid_sealed``,
version 4 with the index's seal); every other case breaks
exactly one rule of the spec, as far as the rule allows.

cases.json maps a case to ``{"error": <class name in recsave.errors or null>, "match": <substring the
message must contain, compared case-insensitively, outside the temporary directory's path>}``, plus
``tensors`` (the reference content) for the valid case and ``setup`` for cases the test completes at run
time (a symlink pointing outside the directory, a sparse 256 MiB index).

Run: ``python tests/corpus/make_corpus.py`` (needs google-crc32c). The helpers here are also used by
tests/test_oracle.py to build checkpoints by hand.
"""
from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import google_crc32c

HERE = Path(__file__).resolve().parent

# FORMAT.md section 4, copied by hand: torch dtype name -> (itemsize, safetensors code or None).
DTYPES: Dict[str, Tuple[int, Optional[str]]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "float16": (2, "F16"), "bfloat16": (2, "BF16"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"),
    "uint64": (8, "U64"), "uint32": (4, "U32"), "uint16": (2, "U16"), "uint8": (1, "U8"),
    "bool": (1, "BOOL"), "complex64": (8, "C64"), "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"), "float8_e4m3fnuz": (1, "F8_E4M3FNUZ"), "float8_e5m2fnuz": (1, "F8_E5M2FNUZ"),
    "complex128": (16, None), "complex32": (4, None), "float8_e8m0fnu": (1, None),
    "float4_e2m1fn_x2": (1, None), "bits8": (1, None), "bits16": (2, None), "bits1x8": (1, None),
    "bits2x4": (1, None), "bits4x2": (1, None),
}

Seg = Tuple[str, Any]  # ("bytes", S) for segment_bytes, ("ends", [..]) for explicit segments


def crc(b: bytes) -> int:
    return google_crc32c.value(bytes(b))


def seg_fields(data: bytes, seg: Seg) -> dict:
    """The segment_bytes / segments and crc32c fields of a chunk holding ``data``."""
    kind, val = seg
    if kind == "bytes":
        ends = [min(len(data), i + val) for i in range(0, len(data), val)] or [0]
        out = {"segment_bytes": val}
    else:
        ends, out = list(val), {"segments": list(val)}
    starts = [0] + ends[:-1]
    out["crc32c"] = [crc(data[s:e]) for s, e in zip(starts, ends)]
    return out


def shard_bytes(entries: Sequence[Tuple[str, str, List[int], bytes]], extra_dtypes: Optional[dict] = None,
                header_override: Optional[bytes] = None) -> Tuple[bytes, Dict[str, int]]:
    """A safetensors file holding ``entries`` (name, code, shape, data) back to back.

    Returns the file bytes and each entry's absolute offset (8 + N + begin)."""
    meta = {"format": "recsave.shard", "format_version": "1"}
    if extra_dtypes:
        meta["recsave.dtypes"] = json.dumps(extra_dtypes, sort_keys=True)
    header: Dict[str, Any] = {"__metadata__": meta}
    pos, rel = 0, {}
    for name, code, shape, data in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        rel[name] = pos
        pos += len(data)
    h = header_override if header_override is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # pad with spaces to a multiple of 8
    blob = struct.pack("<Q", len(h)) + h + b"".join(e[3] for e in entries)
    return blob, {k: 8 + len(h) + v for k, v in rel.items()}


def write_checkpoint(d: Path, tensors: Sequence[dict], partition: Optional[dict] = None) -> dict:
    """Writes a checkpoint into ``d`` by hand and returns its index.

    Each tensor spec: ``name, dtype, shape, data`` (C-order little-endian bytes) and ``parts``: a list of
    ``(file, nrows, seg)`` (nrows None for 0-d tensors), optionally ``buckets`` per part."""
    d.mkdir(parents=True, exist_ok=True)
    per_file: Dict[str, List[Tuple[str, str, List[int], bytes]]] = {}
    extra: Dict[str, Dict[str, str]] = {}
    pending = []  # (tensor name, file, chunk fields without offset)
    for t in tensors:
        itemsize, code = DTYPES[t["dtype"]]
        row_bytes = itemsize
        for dim in t["shape"][1:]:
            row_bytes *= dim
        pos, row = 0, 0
        for k, (fname, nrows, seg) in enumerate(t["parts"]):
            n = row_bytes if nrows is None else nrows * row_bytes
            data = t["data"][pos:pos + n]
            shape = [] if nrows is None else [nrows] + list(t["shape"][1:])
            if code is None:
                extra.setdefault(fname, {})[t["name"]] = t["dtype"]
                per_file.setdefault(fname, []).append((t["name"], "U8", [len(data)], data))
            else:
                per_file.setdefault(fname, []).append((t["name"], code, shape, data))
            c = {"file": fname, "length": len(data), **seg_fields(data, seg)}
            if nrows is not None:
                c["rows"] = [row, row + nrows]
            if t.get("buckets"):
                c["buckets"] = t["buckets"][k]
            pending.append((t["name"], fname, c))
            pos, row = pos + n, row + (nrows or 0)
        assert pos == len(t["data"]), t["name"]
    files, offsets = {}, {}
    for fname, entries in per_file.items():
        blob, offs = shard_bytes(entries, extra.get(fname))
        (d / fname).write_bytes(blob)
        files[fname] = {"size": len(blob), "rank": int(fname.split("-")[1]) if fname.count("-") >= 2 else 0}
        offsets[fname] = offs
    index = {
        "magic": "recsave.index", "format_version": 1, "recsave_version": "0.0.0+corpus",
        "created_at": "2024-01-01T00:00:00Z", "step": 7,
        "world_size": 1 + max(f["rank"] for f in files.values()), "partition": partition,
        "files": files, "tensors": {}, "meta": {},
    }
    for t in tensors:
        index["tensors"][t["name"]] = {"dtype": t["dtype"], "shape": list(t["shape"]), "chunks": []}
    for name, fname, c in pending:
        c["offset"] = offsets[fname][name]
        index["tensors"][name]["chunks"].append(dict(sorted(c.items())))
    write_index(d, index)
    return index


def write_index(d: Path, index: Any) -> None:
    (d / "index").write_text(json.dumps(index, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- cases
F = "sparse-0-0.safetensors"
BASE_DATA = struct.pack("<8f", 0.5, 1.5, -2.0, 3.25, 4.0, -5.5, 6.0, 7.75)  # float32 [4, 2]


def base(d: Path) -> dict:
    """One float32 [4, 2] tensor "t" in one shard file, two uniform segments of 16 bytes."""
    return write_checkpoint(d, [{"name": "t", "dtype": "float32", "shape": [4, 2], "data": BASE_DATA,
                                 "parts": [(F, 4, ("bytes", 16))]}])


def raw_shard(d: Path, header: bytes, data: bytes = BASE_DATA, n: Optional[int] = None) -> None:
    """Tensor "t" float32 [4, 2] in a shard whose header bytes (and header length N) are given by hand;
    the index agrees with the file size and checksums, so only the header is wrong."""
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header) if n is None else n) + header + data
    write_checkpoint(d, [{"name": "t", "dtype": "float32", "shape": [4, 2], "data": BASE_DATA,
                          "parts": [(F, 4, ("bytes", 16))]}])
    (d / F).write_bytes(blob)
    idx = json.loads((d / "index").read_text())
    idx["files"][F]["size"] = len(blob)
    c = idx["tensors"]["t"]["chunks"][0]
    c["offset"] = 8 + len(header)
    c.update(seg_fields(blob[c["offset"]:c["offset"] + 32], ("bytes", 16)))
    write_index(d, idx)


def header_json(entries: Dict[str, Any]) -> bytes:
    return json.dumps(entries).encode()


def edit_index(d: Path, fn: Callable[[dict], Any]) -> None:
    idx = json.loads((d / "index").read_text())
    fn(idx)
    write_index(d, idx)


def chunk0(idx: dict, name: str = "t") -> dict:
    return idx["tensors"][name]["chunks"][0]


def two_tensor(d: Path) -> dict:
    return write_checkpoint(d, [
        {"name": "t", "dtype": "float32", "shape": [4, 2], "data": BASE_DATA, "parts": [(F, 4, ("bytes", 16))]},
        {"name": "u", "dtype": "float32", "shape": [4, 2], "data": BASE_DATA[::-1],
         "parts": [(F, 4, ("bytes", 16))]}])


def recrc(d: Path, c: dict, seg: Seg = ("bytes", 16)) -> None:
    """Recomputes a chunk's checksums over the bytes it now points at, so only the intended rule breaks."""
    for k in ("segment_bytes", "segments"):
        c.pop(k, None)
    c.update(seg_fields((d / c["file"]).read_bytes()[c["offset"]:c["offset"] + c["length"]], seg))


def valid_basic(d: Path) -> List[dict]:
    f0, f1 = "sparse-0-0.safetensors", "sparse-1-0.safetensors"
    specs = [
        {"name": "emb", "dtype": "float32", "shape": [5, 3], "data": struct.pack("<15f", *range(-7, 8)),
         "parts": [(f0, 3, ("bytes", 16)), (f1, 2, ("ends", [8, 24]))]},
        {"name": "step", "dtype": "int64", "shape": [], "data": struct.pack("<q", -123456789012),
         "parts": [(f0, None, ("bytes", 8))]},
        {"name": "empty", "dtype": "float16", "shape": [0, 4], "data": b"", "parts": [(f0, 0, ("ends", [0]))]},
        {"name": "mask", "dtype": "bool", "shape": [3], "data": b"\x01\x00\x01", "parts": [(f0, 3, ("bytes", 2))]},
        {"name": "ids", "dtype": "int32", "shape": [3], "data": struct.pack("<3i", 5, -1, 2**31 - 1),
         "parts": [(f0, 3, ("bytes", 64))], "buckets": [{"first": 1, "row_starts": [0, 1, 1, 3]}]},
        {"name": "half", "dtype": "bfloat16", "shape": [4],
         "data": b"".join(struct.pack("<f", v)[2:] for v in (1.0, -2.0, 0.5, 1e30)),
         "parts": [(f1, 4, ("bytes", 1024))]},
        {"name": "c", "dtype": "complex128", "shape": [2], "data": struct.pack("<4d", 1.0, -1.0, 2.5, 0.0),
         "parts": [(f1, 2, ("ends", [5, 16, 32]))]},
        {"name": "f8", "dtype": "float8_e4m3fn", "shape": [2, 2], "data": bytes([0x38, 0xB8, 0x40, 0x00]),
         "parts": [(f1, 2, ("bytes", 3))]},
        {"name": "zero_d_cplx", "dtype": "complex32", "shape": [], "data": bytes([0x00, 0x3C, 0x00, 0xBC]),
         "parts": [(f1, None, ("bytes", 4))]},
    ]
    write_checkpoint(d, specs, partition={"scheme": "mix64", "num_buckets": 8})
    return specs


def to_version_3(d: Path) -> None:
    """Rewrites the index in ``d`` as FORMAT.md section 3 defines version 3: each distinct bucket
    range once in ``bucket_ranges`` (chunks name theirs by position) and every chunk's CRCs as one
    base64 string of little-endian uint32."""
    def convert(i: dict) -> None:
        i["format_version"] = 3
        ranges: List[dict] = []
        for t in i["tensors"].values():
            for c in t["chunks"]:
                c["crc32c"] = base64.b64encode(struct.pack(f"<{len(c['crc32c'])}I", *c["crc32c"])).decode()
                if "buckets" in c:
                    if c["buckets"] not in ranges:
                        ranges.append(c["buckets"])
                    c["buckets"] = ranges.index(c["buckets"])
        i["bucket_ranges"] = ranges
    edit_index(d, convert)


def valid_v3(d: Path) -> List[dict]:
    """valid_basic's tensors plus one sharing the bucket range of "ids", as version 3."""
    specs = valid_basic(d)
    specs.append({"name": "ids_score", "dtype": "float32", "shape": [3], "data": struct.pack("<3f", 0.25, -8.0, 3.5),
                  "parts": [("sparse-0-0.safetensors", 3, ("ends", [4, 12]))],
                  "buckets": [{"first": 1, "row_starts": [0, 1, 1, 3]}]})
    write_checkpoint(d, specs, partition={"scheme": "mix64", "num_buckets": 8})
    to_version_3(d)
    return specs


def valid_v4(d: Path) -> List[dict]:
    """valid_v3's tensors plus one whose segments are given by the bucket rule, as version 4: int64
    rows of 8 bytes in buckets of 1, 0 and 2 rows, {"step": 8, "min": 16}. By the rule of section 3
    the 8 bytes of the first bucket are under the minimum (no cut at 8), the stretch to the chunk's
    end at 24 is cut every 8 bytes: ends 8, 16, 24."""
    specs = valid_v3(d)
    specs.append({"name": "ids_rule", "dtype": "int64", "shape": [3], "data": struct.pack("<3q", -1, 7, 2**40),
                  "parts": [("sparse-1-0.safetensors", 3, ("ends", [8, 16, 24]))],
                  "buckets": [{"first": 1, "row_starts": [0, 1, 1, 3]}]})
    write_checkpoint(d, specs, partition={"scheme": "mix64", "num_buckets": 8})
    to_version_3(d)

    def name_the_rule(i: dict) -> None:
        i["format_version"] = 4
        c = chunk0(i, "ids_rule")
        del c["segments"]
        c["bucket_segments"] = {"step": 8, "min": 16}
    edit_index(d, name_the_rule)
    return specs


def seal_index(d: Path, after: bytes = b"") -> None:
    """Section 3, "The seal": the index (pretty-printed: nothing asks for compact JSON) without its
    closing brace, then ``,"index_crc32c":N}``, N the CRC32C of the bytes before that text."""
    body = (d / "index").read_bytes().rstrip()
    assert body.endswith(b"}")
    head = body[:-1]
    (d / "index").write_bytes(head + b',"index_crc32c":%d}' % crc(head) + after)


def build(case: str, d: Path) -> Tuple[Optional[str], str, dict]:
    """Builds one case into ``d``; returns (error class name, message substring, extra cases.json fields)."""
    C, V, NF = "CorruptCheckpointError", "FormatVersionError", "CheckpointNotFoundError"
    t_f32 = {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}
    if case == "valid_basic":
        ref = {s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": s["data"].hex()} for s in valid_basic(d)}
        return None, "", {"tensors": ref}
    if case == "valid_v3":
        ref = {s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": s["data"].hex()} for s in valid_v3(d)}
        return None, "", {"tensors": ref}
    if case == "valid_v4":
        ref = {s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": s["data"].hex()} for s in valid_v4(d)}
        return None, "", {"tensors": ref}
    if case == "valid_sealed":
        ref = {s["name"]: {"dtype": s["dtype"], "shape": s["shape"], "hex": s["data"].hex()} for s in valid_v4(d)}
        seal_index(d)
        return None, "", {"tensors": ref}
    if case == "seal_mismatch":  # a digit of step changed after sealing: the index still validates
        valid_v4(d)
        seal_index(d)
        sealed = (d / "index").read_bytes()
        assert sealed.count(b'"step": 7,') == 1
        (d / "index").write_bytes(sealed.replace(b'"step": 7,', b'"step": 9,'))
        return C, "index's bytes have CRC32C", {}
    if case == "seal_not_last":  # a newline after the seal
        valid_v4(d)
        seal_index(d, after=b"\n")
        return C, "index_crc32c", {}
    if case == "file_entry_unknown_key":  # the key a renamed "crc32c" would leave
        base(d)
        edit_index(d, lambda i: i["files"][F].update(zz=1))
        return C, "['zz']", {}
    if case == "chunk_unknown_key":
        base(d)
        edit_index(d, lambda i: chunk0(i).update(zz=1))
        return C, "['zz']", {}
    if case == "v4_rule_in_version_3":
        valid_v4(d)
        edit_index(d, lambda i: i.update(format_version=3))
        return C, "bucket_segments", {}
    if case == "v4_rule_without_buckets":
        valid_v4(d)
        edit_index(d, lambda i: chunk0(i, "ids_rule").pop("buckets"))
        return C, "bucket_segments", {}
    if case == "v4_rule_gives_other_segments":  # step 24: one segment, three CRCs
        valid_v4(d)
        edit_index(d, lambda i: chunk0(i, "ids_rule")["bucket_segments"].update(step=24))
        return C, "crc32c", {}
    if case == "v3_bucket_reference_past_the_list":
        valid_v3(d)
        edit_index(d, lambda i: chunk0(i, "ids").update(buckets=1))
        return C, "position in", {}
    if case == "v3_crc_not_base64":
        base(d)
        to_version_3(d)
        edit_index(d, lambda i: chunk0(i).update(crc32c=chunk0(i)["crc32c"][:-4] + "****"))
        return C, "base64", {}
    if case == "v3_crc_list":  # version 1's form in a version 3 index
        base(d)
        crcs = chunk0(json.loads((d / "index").read_text()))["crc32c"]
        to_version_3(d)
        edit_index(d, lambda i: chunk0(i).update(crc32c=crcs))
        return C, "base64", {}
    if case == "crc_flipped_byte":
        idx = base(d)
        blob = bytearray((d / F).read_bytes())
        blob[chunk0(idx)["offset"] + 21] ^= 0x10
        (d / F).write_bytes(bytes(blob))
        return C, "crc", {}
    if case == "truncated_shard":
        base(d)
        (d / F).write_bytes((d / F).read_bytes()[:-5])
        return C, f"{(d / F).stat().st_size} bytes", {}
    if case == "size_mismatch_longer_file":
        base(d)
        (d / F).write_bytes((d / F).read_bytes() + b"\0" * 8)
        return C, f"{(d / F).stat().st_size} bytes", {}
    if case == "header_len_beyond_file":
        raw_shard(d, header_json({"t": t_f32}), n=4096)
        return C, "header", {}
    if case == "header_len_over_limit":
        raw_shard(d, header_json({"t": t_f32}), n=100 * 1024 * 1024 + 8)
        return C, "header", {}
    if case == "file_shorter_than_8_bytes":
        write_checkpoint(d, [{"name": "t", "dtype": "uint8", "shape": [4], "data": b"\x01\x02\x03\x04",
                              "parts": [(F, 4, ("bytes", 16))]}])
        (d / F).write_bytes(b"\x04\x00\x00\x00")
        edit_index(d, lambda i: (i["files"][F].update(size=4), chunk0(i).update(offset=0), recrc(d, chunk0(i))))
        return C, "header", {}
    if case == "header_not_json":
        raw_shard(d, b'{"t": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]')
        return C, "header", {}
    if case == "header_not_utf8":
        raw_shard(d, b'{"t": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}, "\xff\xfe": 1}')
        return C, "header", {}
    if case == "header_not_object":
        raw_shard(d, b"[1, 2, 3]")
        return C, "header", {}
    if case == "data_offsets_out_of_range":
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [8, 2], "data_offsets": [0, 64]}}))
        return C, "data_offsets", {}
    if case == "data_offsets_overlap":
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]},
                                  "u": {"dtype": "F32", "shape": [4, 2], "data_offsets": [16, 48]}}),
                  data=BASE_DATA + BASE_DATA[:16])
        return C, "overlap", {}
    if case == "header_length_not_shape_x_itemsize":
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 32]}}))
        return C, "shape", {}
    if case == "header_shape_negative":  # (-4) * (-2) * 4 == 32: only the sign check catches it
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [-4, -2], "data_offsets": [0, 32]}}))
        return C, "shape", {}
    if case == "header_shape_overflow":  # (2^61 + 1) * 8 wraps to 8 elements in 64-bit arithmetic
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [2**61 + 1, 8], "data_offsets": [0, 32]}}))
        return C, "shape", {}
    if case == "header_shape_float":
        raw_shard(d, b'{"t": {"dtype": "F32", "shape": [4.0, 2.0], "data_offsets": [0, 32]}}')
        return C, "shape", {}
    if case == "header_ndim_over_32":
        raw_shard(d, header_json({"t": {"dtype": "F32", "shape": [1] * 31 + [4, 2], "data_offsets": [0, 32]}}))
        return C, "shape", {}
    if case == "header_dtype_disagrees":
        raw_shard(d, header_json({"t": {"dtype": "I32", "shape": [4, 2], "data_offsets": [0, 32]}}))
        return C, "header", {}
    if case == "header_u8_without_recsave_dtypes":
        raw_shard(d, header_json({"t": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]}}))
        edit_index(d, lambda i: i["tensors"]["t"].update(dtype="complex128", shape=[2]) or
                   chunk0(i).update(rows=[0, 2]))
        return C, "header", {}
    if case == "chunk_offset_disagrees_with_header":
        two_tensor(d)
        edit_index(d, lambda i: (i["tensors"].pop("u"), chunk0(i).update(offset=chunk0(i)["offset"] + 4),
                                 recrc(d, chunk0(i))))
        return C, "header", {}
    if case == "chunk_offset_beyond_file":
        idx = base(d)
        edit_index(d, lambda i: chunk0(i).update(offset=idx["files"][F]["size"] + 8))
        return C, "beyond", {}
    if case == "chunks_overlap":
        two_tensor(d)
        edit_index(d, lambda i: (chunk0(i, "u").update(offset=chunk0(i, "t")["offset"] + 16),
                                 recrc(d, chunk0(i, "u"))))
        return C, "overlap", {}
    if case in ("rows_gap", "rows_short"):
        # Chunks of 2 and 1 rows in two files. rows_short: shape [4, 2], the rows stop at 3.
        # rows_gap: the second chunk claims rows [3, 4) of a [4, 2] tensor, so row 2 is missing.
        write_checkpoint(d, [{"name": "t", "dtype": "float32", "shape": [4, 2] if case == "rows_short" else [3, 2],
                              "data": BASE_DATA[:24], "parts": [(F, 2, ("bytes", 16)),
                                                                ("sparse-1-0.safetensors", 1, ("bytes", 16))]}])
        if case == "rows_gap":
            edit_index(d, lambda i: (i["tensors"]["t"].update(shape=[4, 2]),
                                     i["tensors"]["t"]["chunks"][1].update(rows=[3, 4])))
        return C, "rows", {}
    if case == "crc_count_mismatch":
        base(d)
        edit_index(d, lambda i: chunk0(i)["crc32c"].append(0))
        return C, "crc", {}
    if case == "crc_value_not_32bit":
        base(d)
        edit_index(d, lambda i: chunk0(i)["crc32c"].__setitem__(0, chunk0(i)["crc32c"][0] + (1 << 32)))
        return C, "crc", {}
    if case == "segments_both":
        base(d)
        edit_index(d, lambda i: chunk0(i).update(segments=[16, 32]))
        return C, "segment", {}
    if case == "segments_neither":
        base(d)
        edit_index(d, lambda i: chunk0(i).pop("segment_bytes"))
        return C, "segment", {}
    if case == "segments_not_increasing":
        base(d)
        edit_index(d, lambda i: recrc(d, chunk0(i), ("ends", [24, 8, 32])))
        return C, "segment", {}
    if case == "segments_last_not_length":
        base(d)
        edit_index(d, lambda i: recrc(d, chunk0(i), ("ends", [8, 16])))
        return C, "segment", {}
    if case == "chunk_length_mismatch":
        base(d)
        edit_index(d, lambda i: (chunk0(i).update(length=28), recrc(d, chunk0(i))))
        return C, "length", {}
    if case == "zero_d_with_rows":
        write_checkpoint(d, [{"name": "t", "dtype": "int64", "shape": [], "data": struct.pack("<q", 3),
                              "parts": [(F, None, ("bytes", 8))]}])
        edit_index(d, lambda i: chunk0(i).update(rows=[0, 1]))
        return C, "rows", {}
    if case == "bad_magic":
        base(d)
        edit_index(d, lambda i: i.update(magic="recsave.idx"))
        return C, "magic", {}
    if case == "format_version_2":
        base(d)
        edit_index(d, lambda i: i.update(format_version=2))
        return V, "version 2", {}
    if case in ("file_name_dotdot", "file_name_absolute", "file_name_with_slash"):
        bad = {"file_name_dotdot": "../x", "file_name_absolute": "/etc/passwd",
               "file_name_with_slash": "sub/sparse-0-0.safetensors"}[case]
        base(d)
        if case == "file_name_with_slash":  # the file really is there: only the name rule refuses it
            (d / "sub").mkdir()
            (d / F).rename(d / bad)

        def rename(i: dict) -> None:
            i["files"][bad] = i["files"].pop(F)
            chunk0(i)["file"] = bad
        edit_index(d, rename)
        return C, bad, {}
    if case == "symlink_outside":
        # The test creates <tmp>/outside/target.safetensors and link.safetensors -> ../outside/target...
        base(d)
        (d / F).rename(d / "target.safetensors")

        def relink(i: dict) -> None:
            i["files"]["link.safetensors"] = i["files"].pop(F)
            chunk0(i)["file"] = "link.safetensors"
        edit_index(d, relink)
        return C, "symbolic link", {"setup": {"symlink": {"link.safetensors": "target.safetensors"}}}
    if case == "missing_shard":
        base(d)
        (d / F).unlink()
        return "IncompleteCheckpointError", F, {}  # the checkpoint exists; a file it lists does not
    if case == "missing_index":
        base(d)
        (d / "index").unlink()
        return NF, "index", {}
    if case == "unknown_dtype":
        base(d)
        edit_index(d, lambda i: i["tensors"]["t"].update(dtype="float33"))
        return C, "float33", {}
    if case == "index_not_json":
        base(d)
        (d / "index").write_bytes(b'{"magic": "recsave.index", "format_version": 1,')
        return C, "json", {}
    if case == "index_not_utf8":
        base(d)
        (d / "index").write_bytes((d / "index").read_bytes().replace(b'"0.0.0+corpus"', b'"0.0.0\xc3\x28"'))
        return C, "utf-8", {}
    if case == "index_not_object":
        base(d)
        (d / "index").write_bytes(b'["recsave.index", 1]\n')
        return C, "object", {}
    if case == "index_too_large":  # the test makes the index a sparse file of 256 MiB + 1 byte
        base(d)
        return "OverLimitError", "limit", {"setup": {"sparse_index_bytes": 256 * 1024 * 1024 + 1}}
    if case == "index_shape_overflow":
        base(d)
        edit_index(d, lambda i: i["tensors"]["t"].update(shape=[2**61 + 1, 8]))
        return C, "shape", {}
    if case == "index_ndim_over_32":
        base(d)
        edit_index(d, lambda i: i["tensors"]["t"].update(shape=[4] + [1] * 32 + [2]))
        return C, "shape", {}
    if case == "index_shape_bool":
        base(d)
        edit_index(d, lambda i: i["tensors"]["t"].update(shape=[4, True]))
        return C, "shape", {}
    if case == "index_size_string":
        base(d)
        edit_index(d, lambda i: i["files"][F].update(size=str(i["files"][F]["size"])))
        return C, "size", {}
    if case == "index_offset_float":
        base(d)
        edit_index(d, lambda i: chunk0(i).update(offset=float(chunk0(i)["offset"])))
        return C, "offset", {}
    raise KeyError(case)


CASES = [
    "valid_basic", "crc_flipped_byte", "truncated_shard", "size_mismatch_longer_file", "header_len_beyond_file",
    "header_len_over_limit", "file_shorter_than_8_bytes", "header_not_json", "header_not_utf8",
    "header_not_object", "data_offsets_out_of_range", "data_offsets_overlap", "header_length_not_shape_x_itemsize",
    "header_shape_negative", "header_shape_overflow", "header_shape_float", "header_ndim_over_32",
    "header_dtype_disagrees", "header_u8_without_recsave_dtypes", "chunk_offset_disagrees_with_header",
    "chunk_offset_beyond_file", "chunks_overlap", "rows_gap", "rows_short", "crc_count_mismatch",
    "crc_value_not_32bit", "segments_both", "segments_neither", "segments_not_increasing",
    "segments_last_not_length", "chunk_length_mismatch", "zero_d_with_rows", "bad_magic", "format_version_2",
    "file_name_dotdot", "file_name_absolute", "file_name_with_slash", "symlink_outside", "missing_shard",
    "missing_index", "unknown_dtype", "index_not_json", "index_not_utf8", "index_not_object", "index_too_large",
    "index_shape_overflow", "index_ndim_over_32", "index_shape_bool", "index_size_string", "index_offset_float",
    "valid_v3", "v3_bucket_reference_past_the_list", "v3_crc_not_base64", "v3_crc_list",
    "valid_v4", "v4_rule_in_version_3", "v4_rule_without_buckets", "v4_rule_gives_other_segments",
    "valid_sealed", "seal_mismatch", "seal_not_last", "file_entry_unknown_key", "chunk_unknown_key",
]


def main(out: Path = HERE) -> None:
    """Writes every case under ``out`` (the corpus directory by default) and ``out/cases.json``."""
    cases = {}
    for case in CASES:
        d = out / case
        if d.exists():
            shutil.rmtree(d)
        error, match, extra = build(case, d)
        cases[case] = {"error": error, "match": match, **extra}
    (out / "cases.json").write_text(json.dumps(cases, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(cases)} cases, {total} bytes in {out}")


if __name__ == "__main__":
    main()
