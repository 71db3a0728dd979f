"""The corpus of hand-built checkpoints (tests/corpus, made by make_corpus.py) against both readers.

Every hostile case must raise exactly the error class named in cases.json, with the expected substring
in its message (case-insensitive); the valid case must give back the reference tensors byte for byte.
The two readers are the pure-Python oracle and the engine-backed ``recsave.format.read_tensors``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict

import pytest
import torch

import recsave.errors
from recsave.format import oracle

CORPUS = Path(__file__).resolve().parent / "corpus"
CASES: Dict[str, dict] = json.loads((CORPUS / "cases.json").read_text())


def _engine(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    from recsave.format import read_tensors  # the engine-backed reader (recsave/format/reader.py)

    return read_tensors(ckpt_dir, names=None, verify=True)


def _oracle(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    return oracle.read_tensors(ckpt_dir, None, verify=True)


READERS: Dict[str, Callable[[str], Dict[str, torch.Tensor]]] = {"oracle": _oracle, "engine": _engine}


def materialize(case: str, tmp_path: Path) -> str:
    """Copies a case to ``tmp_path/ckpt`` and applies its run-time setup; returns the checkpoint dir."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CORPUS / case, ckpt)
    setup = CASES[case].get("setup", {})
    for link, target in setup.get("symlink", {}).items():
        # The target is a complete, valid shard file outside the checkpoint directory: a reader that
        # follows the link would load it without complaint.
        outside = tmp_path / "outside"
        outside.mkdir()
        shutil.move(str(ckpt / target), str(outside / target))
        os.symlink(os.path.join("..", "outside", target), ckpt / link)
    if "sparse_index_bytes" in setup:  # extended with a hole: costs no disk space
        os.truncate(ckpt / "index", setup["sparse_index_bytes"])
    return str(ckpt)


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_corpus_case(case: str, reader: str, tmp_path: Path) -> None:
    spec = CASES[case]
    ckpt = materialize(case, tmp_path)
    if spec["error"] is None:
        got = READERS[reader](ckpt)
        ref = spec["tensors"]
        assert sorted(got) == sorted(ref)
        for name, r in ref.items():
            t = got[name]
            assert str(t.dtype) == "torch." + r["dtype"], name
            assert list(t.shape) == r["shape"], name
            assert raw(t) == bytes.fromhex(r["hex"]), name
        return
    cls = getattr(recsave.errors, spec["error"])
    with pytest.raises(cls) as info:
        READERS[reader](ckpt)
    assert type(info.value) is cls, f"{type(info.value).__name__} is not exactly {cls.__name__}: {info.value}"
    # The temporary path holds the test's name, hence the case's: match only the rest of the message.
    message = str(info.value).replace(str(tmp_path), "<tmp>")
    assert spec["match"].lower() in message.lower(), message


def test_corpus_is_complete_and_small() -> None:
    hostile = [c for c, s in CASES.items() if s["error"]]
    assert len(hostile) >= 20 and "valid_basic" in CASES
    assert all(hasattr(recsave.errors, s["error"]) for s in CASES.values() if s["error"])
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 200 * 1024


def test_corpus_matches_generator(tmp_path: Path) -> None:
    """The committed files are exactly what make_corpus.py produces (regenerate after editing it)."""
    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(tmp_path)
    fresh = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(CORPUS) for p in CORPUS.rglob("*")
                 if p.is_file() and p.name != "make_corpus.py" and "__pycache__" not in p.parts}
    assert fresh == committed
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (CORPUS / rel).read_bytes(), str(rel)
