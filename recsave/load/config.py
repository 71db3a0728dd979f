"""Load / model-bank configuration (docs/API.md, "Load / model-bank config"): parse an entry, then
resolve it against what the model has and what a checkpoint holds into a plan — every check done
before anything is modified."""
from __future__ import annotations

import fnmatch
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from recsave.errors import ConfigError, ShapeMismatchError

if TYPE_CHECKING:
    from recsave.format.records import Index

CATEGORIES = ("*", "sparse", "dense", "extra", "sparse_opt", "io_state")
ENTRY_KEYS = ("path", "load", "exclude", "strict", "oname", "hashtable_clear", "ignore_error", "skip",
              "is_dynamic", "dim_policy", "dtype_policy")
DIM_POLICIES = ("error", "truncate", "pad")
DTYPE_POLICIES = ("error", "cast")
SPARSE_OPTIM = "sparse_optim"  # extra holding the sparse optimizer's scalar state


def sparse_optim_steps(extras: Any) -> Optional[Dict[str, Any]]:
    """The per-table step counts (`steps`) of the sparse optimizer's state in a checkpoint's
    decoded extra.pt (extra name -> state), None when it holds none."""
    state = extras.get(SPARSE_OPTIM) if isinstance(extras, dict) else None
    steps = state.get("steps") if isinstance(state, dict) else None
    return steps if isinstance(steps, dict) else None


@dataclass(frozen=True)
class LoadConf:
    path: Optional[str] = None
    load: Tuple[str, ...] = ("*",)
    exclude: Tuple[str, ...] = ()
    strict: bool = True
    oname: Tuple[Tuple[str, str], ...] = ()
    hashtable_clear: bool = True
    ignore_error: bool = False
    skip: bool = False
    is_dynamic: bool = False
    dim_policy: str = "error"      # embedding dim differs: error | truncate (checkpoint wider) | pad (narrower)
    dtype_policy: str = "error"    # dtype differs: error | cast


def parse(conf: Optional[Mapping[str, Any]], *, where: str = "load_conf", path: Optional[str] = None,
          require_path: bool = False) -> LoadConf:
    """Validates a config dict; ConfigError names the offending key and what to do."""
    if conf is not None and not isinstance(conf, Mapping):
        shown = repr(conf) if len(repr(conf)) <= 60 else repr(conf)[:57] + "..."
        raise ConfigError(f"{where} must be a dict like {{'path': ...}} (keys: {list(ENTRY_KEYS)}), got "
                          f"{type(conf).__name__} {shown}")
    conf = dict(conf or {})
    unknown = sorted(set(conf) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {list(ENTRY_KEYS)}")
    p = conf.get("path", path)
    if require_path and p is None:
        raise ConfigError(f"{where}: 'path' is required (a checkpoint directory or an output dir)")
    if p is not None and (not isinstance(p, str) or not p):
        raise ConfigError(f"{where}: 'path' must be a non-empty string, got {p!r}")
    load = _patterns(conf.get("load", ["*"]), "load", where)
    exclude = _patterns(conf.get("exclude", []), "exclude", where)
    flags: Dict[str, bool] = {}
    for key, default in (("strict", True), ("hashtable_clear", True), ("ignore_error", False), ("skip", False),
                         ("is_dynamic", False)):
        value = conf.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key!r} must be true or false, got {value!r}")
        flags[key] = value
    policies: Dict[str, str] = {}
    for key, allowed in (("dim_policy", DIM_POLICIES), ("dtype_policy", DTYPE_POLICIES)):
        value = conf.get(key, "error")
        if value not in allowed:
            raise ConfigError(f"{where}: {key!r} must be one of {list(allowed)}, got {value!r}")
        policies[key] = value
    return LoadConf(path=p, load=load, exclude=exclude, oname=_renames(conf.get("oname", []), where),
                    dim_policy=policies["dim_policy"], dtype_policy=policies["dtype_policy"], **flags)


def _patterns(value: Any, key: str, where: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key!r} must be a list of categories {list(CATEGORIES)} or "
                          f"name patterns, got {value!r}")
    return tuple(value)


def _renames(value: Any, where: str) -> Tuple[Tuple[str, str], ...]:
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: 'oname' must be a list of {{model_pattern: checkpoint_pattern}}")
    pairs = []
    for item in value:
        if not isinstance(item, dict) or not item:
            raise ConfigError(f"{where}: 'oname' items must be non-empty dicts, got {item!r}")
        for model_pat, ckpt_pat in item.items():
            if not isinstance(model_pat, str) or not isinstance(ckpt_pat, str) or not model_pat or not ckpt_pat:
                raise ConfigError(f"{where}: 'oname' maps names to names, got {model_pat!r}: {ckpt_pat!r}")
            if model_pat.count("*") != ckpt_pat.count("*"):
                raise ConfigError(f"{where}: 'oname' {model_pat!r} -> {ckpt_pat!r}: use '*' on both "
                                  f"sides (the same number of times) or on neither")
            if any(c in model_pat + ckpt_pat for c in "?["):
                raise ConfigError(f"{where}: 'oname' patterns support only '*', got {model_pat!r} -> {ckpt_pat!r}")
            if "@" in model_pat + ckpt_pat:  # it would match no name and load the slot unrenamed
                raise ConfigError(f"{where}: 'oname' {model_pat!r} -> {ckpt_pat!r}: renames name tables, dense "
                                  f"tensors and registered objects, not slots (a table's slots follow its "
                                  f"rename); load the other slot into a table of its own instead")
            pairs.append((model_pat, ckpt_pat))
    return tuple(pairs)


@dataclass
class TableInfo:
    dim: int
    dtype: str  # the embedding's
    slots: Tuple[str, ...]
    rows: int = 0
    slot_dtypes: Dict[str, str] = field(default_factory=dict)  # a slot not listed has `dtype`

    def __post_init__(self) -> None:  # only the slots of another dtype: equal infos compare equal
        self.slot_dtypes = {s: d for s, d in self.slot_dtypes.items() if d != self.dtype}

    def dtype_of(self, column: str) -> str:
        """The dtype of column 'embedding' or of a slot."""
        return self.dtype if column == "embedding" else self.slot_dtypes.get(column, self.dtype)


@dataclass
class Contents:
    """The names a model (with its saver) or a checkpoint holds, by category."""
    tables: Dict[str, TableInfo] = field(default_factory=dict)
    dense: Dict[str, Tuple[Tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype)
    extras: Set[str] = field(default_factory=set)
    io_states: Set[str] = field(default_factory=set)
    optional: Set[str] = field(default_factory=set)  # names a checkpoint may lack (never "missing")
    # name -> other names reading the same data (a PyTorch source's `emb.weight` is dense and table
    # `emb`): a name whose alias is loaded is not reported unexpected.
    aliases: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

    def categories(self) -> Dict[str, str]:
        out: Dict[str, str] = {}
        for t, info in self.tables.items():
            out[t] = "sparse"
            for s in info.slots:
                out[f"{t}@{s}"] = "sparse_opt"
        for n in self.dense:
            out[n] = "dense"
        for n in self.extras:
            out[n] = "sparse_opt" if n == SPARSE_OPTIM else "extra"
        for n in self.io_states:
            out[n] = "io_state"
        return out

    def holds(self, name: str, category: str) -> bool:
        """Whether `name` is there as `category`. Unlike categories(), a name may be there as two:
        a torch source's bare 2-D tensor `user` is both dense `user` and table `user`."""
        if category == "sparse":
            return name in self.tables
        if category == "sparse_opt":
            table, _, slot = name.partition("@")
            return name in self.extras if name == SPARSE_OPTIM else table in self.tables and \
                slot in self.tables[table].slots
        if category == "dense":
            return name in self.dense
        if category == "extra":
            return name in self.extras and name != SPARSE_OPTIM
        return category == "io_state" and name in self.io_states


@dataclass
class Plan:
    """One entry resolved against a checkpoint: model name -> checkpoint name, per category."""
    conf: LoadConf
    ckpt_dir: str
    index: Optional[Index]  # None for a Parquet source
    items: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # model name -> (category, source)
    skipped: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    note_names: List[str] = field(default_factory=list)  # the model name each note is about
    # Selected names whose dim / dtype do not fit: raised by raise_incompatible for the names this
    # entry wins (a later entry that loads the name instead makes it moot).
    incompatible: Dict[str, ShapeMismatchError] = field(default_factory=dict)


def _matches(item: str, name: str, category: str) -> bool:
    if item == "*":
        return True
    if item in CATEGORIES:
        return item == category
    return fnmatch.fnmatchcase(name, item)


def _compile_rename(model_pat: str, ckpt_pat: str):
    regex = re.compile("".join("(.*)" if c == "*" else re.escape(c) for c in model_pat) + r"\Z")
    pieces = ckpt_pat.split("*")

    def apply(name: str) -> Optional[str]:
        m = regex.match(name)
        if not m:
            return None
        out = pieces[0]
        for group, piece in zip(m.groups(), pieces[1:]):
            out += group + piece
        return out
    return apply


def _renamed_part(name: str, category: str) -> str:
    """The part of a model name that `oname` renames: a table's name, for its slots too."""
    return name.partition("@")[0] if category in ("sparse", "sparse_opt") and "@" in name else name


def _warn_category_names(conf: LoadConf, model_names: Dict[str, str], ckpt_names: Dict[str, str],
                         ckpt_dir: str) -> None:
    """A load / exclude item that is a category word always means the category: a table, dense
    tensor or object of that name is not picked by it, which its author may not expect."""
    for item in sorted(set(conf.load + conf.exclude) & (set(CATEGORIES) - {"*"})):
        kind = model_names.get(item) or ckpt_names.get(item)  # what a name spelt like the word is
        if kind is not None and kind != item:
            warnings.warn(f"{ckpt_dir}: {item!r} in 'load' / 'exclude' means the category {item!r}, not the "
                          f"{kind} name {item!r}; to pick that name write {'[' + item[0] + ']' + item[1:]!r}",
                          RuntimeWarning, stacklevel=4)


def _warn_slots_without_their_table(result: Plan, model_names: Dict[str, str], ckpt_dir: str,
                                    hits: Callable[[str, str, str, str], bool]) -> None:
    """`exclude: ["user"]` names table `user`'s rows only: its slots (`user@*`, category
    sparse_opt) still load onto the live rows, with the source's optimizer step count. That is a
    slot-only load, which an author who excluded the table by name most likely did not mean: said
    once, naming the tables (not for a table `load` left out, e.g. `load: ["sparse_opt"]` or
    `load: ["user@*"]`). `hits` is plan()'s: a pattern naming no model name names sources."""
    conf = result.conf

    def named_out(n: str) -> bool:  # selected by `load`, left out by a name in `exclude`
        src = source_name(n, "sparse", conf)
        return any(hits(i, n, src, "sparse") for i in conf.load) and \
            any(i not in CATEGORIES and hits(i, n, src, "sparse") for i in conf.exclude)
    excluded = [n for n in result.skipped if model_names.get(n) == "sparse" and named_out(n)]
    slots = {t: sorted(n for n in result.items if n.startswith(t + "@")) for t in excluded}
    slots = {t: names for t, names in slots.items() if names}
    if slots:
        warnings.warn(f"{ckpt_dir}: 'exclude' leaves out table(s) {sorted(slots)} but not their slots, which "
                      f"load onto the live rows: {sum(slots.values(), [])}; to leave a table out whole, "
                      f"exclude '<table>@*' too (e.g. {sorted(slots)[0] + '@*'!r})", RuntimeWarning, stacklevel=4)


def raise_incompatible(plans: Sequence[Plan], won: Sequence[Mapping[str, Tuple[str, str]]]) -> None:
    """The first ShapeMismatchError plan() found for a name its entry wins (in entry order)."""
    for p, w in zip(plans, won):
        for name in sorted(p.incompatible):
            if name in w:
                raise p.incompatible[name]


def recheck(plan: Plan, model: Contents, ckpt: Contents, won: Mapping[str, Tuple[str, str]]) -> None:
    """At execution, the names the plan wins (`won`) against the model as it is now (a plan may
    be executed after the model changed): ConfigError for a name gone or of another kind,
    ShapeMismatchError where plan() would raise it (a dim or dtype changed)."""
    now = model.categories()
    for name, (category, src) in won.items():
        if now.get(name) != category:
            raise ConfigError(f"{plan.ckpt_dir}: the plan loads {category} {name!r}, which the model "
                              f"{'no longer has' if name not in now else 'now holds as ' + now[name]}; "
                              f"make the plan again (plan_model_bank)", path=plan.ckpt_dir, key=name)
        _check_compatible(name, src, category, model, ckpt, plan.ckpt_dir, plan.conf)


def source_name(name: str, category: str, conf: LoadConf) -> str:
    """The checkpoint name a model name loads from, after `oname` (the last matching pair wins).
    Table renames apply to the table part, so a table's slots follow it."""
    base = _renamed_part(name, category)
    for model_pat, ckpt_pat in reversed(conf.oname):
        renamed = _compile_rename(model_pat, ckpt_pat)(base)
        if renamed is not None:
            return renamed + name[len(base):]
    return name


def plan(conf: LoadConf, model: Contents, ckpt: Contents, ckpt_dir: str, index: Optional[Index]) -> Plan:
    """Resolves `conf` against the model and the checkpoint. Raises ConfigError / ShapeMismatchError
    before anything is modified."""
    result = Plan(conf, ckpt_dir, index)
    model_names = model.categories()
    ckpt_names = ckpt.categories()
    if not conf.ignore_error:
        for item in conf.load + conf.exclude:
            if item in CATEGORIES:
                continue
            if not any(fnmatch.fnmatchcase(n, item) for n in list(model_names) + list(ckpt_names)):
                raise ConfigError(
                    f"{ckpt_dir}: pattern {item!r} matches nothing in the model or the checkpoint; "
                    f"fix it or set ignore_error=True (model names e.g. {sorted(model_names)[:8]}, "
                    f"checkpoint names e.g. {sorted(ckpt_names)[:8]})", path=ckpt_dir, key=item)
        # A misspelt rename would leave its model names loading from their own names, which a
        # source may hold too (with the same dim): a silent wrong load.
        for model_pat, ckpt_pat in conf.oname:
            renames = _compile_rename(model_pat, ckpt_pat)
            if not any(renames(_renamed_part(n, c)) is not None for n, c in model_names.items()):
                raise ConfigError(
                    f"{ckpt_dir}: 'oname' {model_pat!r} -> {ckpt_pat!r}: {model_pat!r} matches no name of the "
                    f"model (its side comes first: {{model_name: checkpoint_name}}); fix it or set "
                    f"ignore_error=True (model names e.g. {sorted(model_names)[:8]})", path=ckpt_dir, key=model_pat)
    _warn_category_names(conf, model_names, ckpt_names, ckpt_dir)
    used_sources = set()
    skipped_sources: Set[str] = set()
    # A pattern names model names; one that names none (the check above accepts checkpoint names)
    # names the sources of renamed ones instead, so that it is never accepted and then ignored.
    names_model = {i: i in CATEGORIES or any(fnmatch.fnmatchcase(n, i) for n in model_names)
                   for i in conf.load + conf.exclude}

    def hits(item: str, name: str, src: str, category: str) -> bool:
        if names_model[item]:
            return _matches(item, name, category)
        return src != name and _matches(item, src, category)

    for name, category in sorted(model_names.items()):
        src = source_name(name, category, conf)
        selected = any(hits(i, name, src, category) for i in conf.load) and \
            not any(hits(i, name, src, category) for i in conf.exclude)
        if not selected:
            result.skipped.append(name)
            skipped_sources.add(src)  # left out on purpose: not "unexpected" either
            continue
        if not ckpt.holds(src, category):
            if name in model.optional:  # e.g. the manager's global_step in a plain Saver's checkpoint
                result.skipped.append(name)
                result.notes.append(f"{ckpt_dir}: {name!r} is not in the checkpoint; it is registered as "
                                    f"optional and keeps its current state")
                result.note_names.append(name)
            else:
                result.missing.append(name)
            continue
        try:
            _check_compatible(name, src, category, model, ckpt, ckpt_dir, conf)
        except ShapeMismatchError as exc:
            result.incompatible[name] = exc
        result.items[name] = (category, src)
        used_sources.add(src)
    for src, category in sorted(ckpt_names.items()):
        if src in used_sources or src in skipped_sources or any(a in used_sources for a in ckpt.aliases.get(src, ())):
            continue
        if any(_matches(i, src, category) for i in conf.load) and \
                not any(_matches(i, src, category) for i in conf.exclude):
            result.unexpected.append(src)
    _warn_slots_without_their_table(result, model_names, ckpt_dir, hits)
    # A tensor unexpected both as a table (or slot) and as dense is reported once, by its key.
    result.unexpected = [n for n in result.unexpected if not (
        ckpt_names[n] in ("sparse", "sparse_opt") and any(a in result.unexpected for a in ckpt.aliases.get(n, ())))]
    if conf.strict and result.missing:
        raise ConfigError(
            f"{ckpt_dir}: the checkpoint lacks {len(result.missing)} selected name(s) of the model: "
            f"{result.missing[:10]}; exclude them, rename with 'oname', or set strict=False",
            path=ckpt_dir, key=result.missing[0])
    if model_names and not result.items and not result.missing and not result.notes and not conf.ignore_error:
        # e.g. load: [] or exclude: ["*"]: the entry would succeed having loaded nothing.
        raise ConfigError(f"{ckpt_dir}: load {list(conf.load)} with exclude {list(conf.exclude)} selects "
                          f"nothing of the model to load; fix load / exclude, drop the entry, or set "
                          f"ignore_error=True", path=ckpt_dir)
    return result


def _check_compatible(name: str, src: str, category: str, model: Contents, ckpt: Contents,
                      ckpt_dir: str, conf: LoadConf) -> None:
    if category in ("sparse", "sparse_opt") and name != SPARSE_OPTIM:
        (table, _, slot), (src_table, _, src_slot) = name.partition("@"), src.partition("@")
        mt, ct = model.tables[table], ckpt.tables[src_table]
        # each slot against its own dtype: a source may hold slots of another dtype than its embedding
        mdtype, cdtype = mt.dtype_of(slot or "embedding"), ct.dtype_of(src_slot or "embedding")
        what = f"slot {src!r}" if src_slot else f"table {src!r}"
        if mdtype != cdtype and conf.dtype_policy != "cast":
            raise ShapeMismatchError(
                f"{ckpt_dir}: {what} is {cdtype} but the model's {name!r} is {mdtype}; set "
                f"dtype_policy='cast' to convert, or exclude it", path=ckpt_dir, key=name)
        if mt.dim != ct.dim:
            fits = {"truncate": ct.dim > mt.dim, "pad": ct.dim < mt.dim}.get(conf.dim_policy, False)
            if not fits:
                hint = "truncate" if ct.dim > mt.dim else "pad"
                raise ShapeMismatchError(
                    f"{ckpt_dir}: {what} has dim {ct.dim} but the model's {name!r} has dim "
                    f"{mt.dim}; set dim_policy={hint!r} to load it anyway, or exclude it",
                    path=ckpt_dir, key=name)
    elif category == "dense":
        (ms, md), (cs, cd) = model.dense[name], ckpt.dense[src]
        if tuple(ms) != tuple(cs) or (md != cd and conf.dtype_policy != "cast"):
            raise ShapeMismatchError(
                f"{ckpt_dir}: dense {src!r} is {cd}{list(cs)} but the model's {name!r} is "
                f"{md}{list(ms)}; exclude it or fix the model" + (
                    " (dtype_policy='cast' converts dtypes)" if tuple(ms) == tuple(cs) else ""),
                path=ckpt_dir, key=name)


def winners(plans: Sequence[Plan]) -> List[Dict[str, Tuple[str, str]]]:
    """For overlapping entries the later one wins a name: each plan keeps only the names it wins."""
    owner: Dict[str, int] = {}
    for i, p in enumerate(plans):
        for name in p.items:
            owner[name] = i
    return [{n: item for n, item in p.items.items() if owner[n] == i} for i, p in enumerate(plans)]
