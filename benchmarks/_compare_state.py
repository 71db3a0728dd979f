"""compare.py's state: the layout of its embedding tables (ids, weights, optimizer slots), a model of
recsave HashTables holding the same ids and values as engine.build_state, and the round-trip check."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import engine as E  # the dict-of-tensors form of the state is engine.build_state

Layout = List[Tuple[str, str, Tuple[int, ...]]]


def slot_names(slots: int) -> List[str]:
    return {0: [], 1: ["adagrad_acc"], 2: ["adam_m", "adam_v"]}.get(slots, [f"slot_{j}" for j in range(slots)])


def state_layout(size_bytes: int, tables: int, dim: int, slots: int, rows: Optional[int] = None) -> Layout:
    """Per table: int64 ids [rows], float32 weight [rows, dim] and `slots` float32 [rows, dim] slots;
    `rows` per table, else sized to about `size_bytes` in all. engine.build_state fills it."""
    rows = rows or max(1, size_bytes // (tables * (8 + 4 * dim * (1 + slots))))
    out: Layout = []
    for i in range(tables):
        out += [(f"table_{i}.ids", "int64", (rows,)), (f"table_{i}.weight", "float32", (rows, dim))]
        out += [(f"table_{i}.{s}", "float32", (rows, dim)) for s in slot_names(slots)]
    return out


def build_model(layout: Layout, seed: int, fill: bool, bucket_order: bool = False) -> Any:
    """A ModuleDict of recsave.HashTables matching `layout`; with `fill`, holding exactly the ids and
    values engine.build_state(layout, seed) makes (rows filled in place: no second copy). With
    `bucket_order`, each table's rows are in the order a restore leaves them (ids sorted by bucket,
    as a checkpoint's files hold them); the values are drawn in the same sequence, so the rows hold
    the same bytes under other ids."""
    import torch

    import recsave
    from recsave import partition

    g = torch.Generator().manual_seed(seed)
    model, views = torch.nn.ModuleDict(), {}
    columns = defaultdict(list)
    for name, _dtype, _shape in layout:
        table, col = name.split(".", 1)
        if col != "ids":
            columns[table].append("embedding" if col == "weight" else col)
    for k, (name, _dtype, shape) in enumerate(layout):
        table, col = name.split(".", 1)
        if col == "ids":
            t = model[table] = recsave.HashTable(layout[k + 1][2][1], name=table)
            for slot in columns[table][1:]:
                t.add_slot(slot)
            if fill:
                ids = torch.arange(shape[0]).mul_(len(layout)).add_(k)  # as engine.build_state
                if bucket_order:
                    ids = ids[torch.argsort(partition.bucket_of(ids), stable=True)]
                views = t.prepare_load(ids, columns[table])
                if views is None:
                    raise RuntimeError(f"{table}: HashTable.prepare_load refused the ids")
        elif fill:
            views["embedding" if col == "weight" else col].uniform_(-0.05, 0.05, generator=g)
    return model


def gathered_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """engine.build_state's tensors as the Saver writes a freshly filled model's tables: each
    table's columns taken in the bucket order of its ids (format.RowSource.take: the engine gathers
    the rows on its writer threads, no copy made here). The permutation is computed here, before
    the timed write; the Saver computes its own during its save (about 4 ms per table of 480k
    rows on the development VM), and writes two row-metadata columns more: this row leaves both
    out, so "Saver / engine gathering the same rows" is the Saver's own cost on top."""
    from recsave import format as fmt
    from recsave import partition

    order: Dict[str, Any] = {}
    out: Dict[str, Any] = {}
    for name, tensor in state.items():
        table, col = name.split(".", 1)
        if col == "ids":
            import torch
            order[table] = torch.argsort(partition.bucket_of(tensor), stable=True)
        out[name] = fmt.RowSource.take(tensor, order[table])
    return out


def model_mismatches(model: Any, layout: Layout, seed: int) -> List[str]:
    """Names of `layout` whose values in the model's tables differ from engine.build_state's."""
    import torch

    expected, bad = E.build_state(layout, seed), []
    for k, (name, _dtype, _shape) in enumerate(layout):
        table, col = name.split(".", 1)
        if col != "ids":
            continue
        t = model[table]
        ids, rows = t.id_rows()
        pos = (ids - k) // len(layout)
        if ids.numel() != expected[name].numel() or not torch.equal(expected[name][pos], ids):
            bad.append(name)
            continue
        for other, _, _ in layout:
            if other.startswith(table + ".") and other != name:
                c = other.split(".", 1)[1]
                storage = t.weight if c == "weight" else t.slot(c)
                if not torch.equal(storage.index_select(0, rows), expected[other].index_select(0, pos)):
                    bad.append(other)
    return bad

