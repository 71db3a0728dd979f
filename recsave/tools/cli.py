"""The `recsave` command line: ``recsave COMMAND ...`` (also ``python -m recsave.cli``).

Each subcommand is a small function registered with :func:`command`; it receives the parsed
arguments and returns the exit code. Expected failures print ``recsave: error: <message>`` on
stderr, without a traceback (with ``--json`` also an ``{"error": ...}`` document on stdout).

Exit codes, the same for every command (docs/API.md section 7): 0 ok; 1 damage found (verify's
problems, or a CorruptCheckpointError); 2 usage error, not found, or another RecsaveError (e.g. the
output dir is locked; an index over the knob max_index_bytes, OverLimitError, which may be intact);
3 an I/O error (StorageError or another OSError); 4 an unexpected error (its traceback is printed);
130 interrupted.

To add one::

    def _arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("output_dir")

    @command("name", "what it does", _arguments)
    def _handler(args: argparse.Namespace) -> int:
        ...
        return 0
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, cast

from recsave.errors import CorruptCheckpointError, OverLimitError, RecsaveError, StorageError, UsageError
from recsave.version import __version__

Handler = Callable[[argparse.Namespace], int]
Arguments = Callable[[argparse.ArgumentParser], None]

EXIT_OK = 0
EXIT_DAMAGED = 1   # damage found: verify's problems, or a CorruptCheckpointError
EXIT_ERROR = 2     # bad command-line usage, not found, or another RecsaveError
EXIT_IO = 3        # an I/O error: StorageError or another OSError
EXIT_UNEXPECTED = 4  # an error recsave did not expect (a bug, or a library's own error): traceback shown
EXIT_INTERRUPTED = 130
EXIT_FAILURE = EXIT_DAMAGED  # the name of earlier releases

_COMMANDS: Dict[str, Tuple[str, Arguments, Handler]] = {}


def command(name: str, help: str, arguments: Arguments) -> Callable[[Handler], Handler]:
    """Registers `handler` as subcommand `name`; `arguments` adds its options to its parser."""
    def register(handler: Handler) -> Handler:
        if name in _COMMANDS:
            raise ValueError(f"recsave command {name!r} is registered twice")
        _COMMANDS[name] = (help, arguments, handler)
        return handler
    return register


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _name_list(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one table name, e.g. --tables user,item")
    return names


# ------------------------------------------------------------------------------------ export
def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory, or output dir (its latest checkpoint); "
                                                "a local path or an fsspec URL (with --since: the newer one)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write <table>/part-*.parquet and the manifest")
    p.add_argument("--tables", type=_name_list, default=None, metavar="A,B",
                   help="comma-separated tables to export (default: all)")
    p.add_argument("--row-group-rows", type=_positive_int, default=65536, metavar="N",
                   help="rows per Parquet row group, i.e. per read/write step (default: 65536)")
    p.add_argument("--rows-per-file", type=_positive_int, default=None, metavar="N",
                   help="start a new part file every N rows (default: one file per table)")
    p.add_argument("--since", default=None, metavar="OLD",
                   help="write the delta feed from checkpoint OLD to CKPT instead (rows upserted / deleted, "
                        "recsave_delta.json; docs/FORMAT.md section 7)")


@command("export", "export a checkpoint's tables to Parquet (one dataset per table)", _export_arguments)
def _export(args: argparse.Namespace) -> int:
    from recsave.storage import get_storage
    from recsave.tools.catalog import describe
    from recsave.tools.export import MANIFEST, to_parquet
    from recsave.tools.progress import Progress

    if args.since is not None:
        return _export_delta(args)
    tables = describe(args.ckpt, "export")["tables"]
    with Progress("export", sum(t["rows"] for n, t in tables.items() if args.tables is None or n in args.tables),
                  unit=" k rows", scale=1e3) as bar:
        manifest = to_parquet(args.ckpt, args.out_dir, args.tables, row_group_rows=args.row_group_rows,
                              rows_per_file=args.rows_per_file, progress=bar.advance)
    step = manifest["step"]
    print(f"exported {manifest['source']}" + (f" (step {step})" if step is not None else "") + f" to {args.out_dir}")
    total_rows = total_bytes = total_files = 0
    for name, t in sorted(manifest["tables"].items()):
        nbytes = sum(f["size"] for f in t["files"])
        slots = ", ".join(t["slots"]) or "no slots"
        print(f"  {name}: {t['rows']} rows, dim {t['dim']} {t['dtype']} ({slots}), {len(t['files'])} file(s), "
              f"{_human(nbytes)}")
        for f in t["files"]:
            print(f"    {f['path']}  {f['rows']} rows  {f['size']} bytes")
        total_rows += t["rows"]
        total_bytes += nbytes
        total_files += len(t["files"])
    print(f"{len(manifest['tables'])} table(s), {total_rows} rows, {total_files} file(s), {total_bytes} bytes "
          f"({_human(total_bytes)}); manifest {get_storage(args.out_dir).join(args.out_dir, MANIFEST)}")
    return EXIT_OK


def _export_delta(args: argparse.Namespace) -> int:
    from recsave.storage import get_storage
    from recsave.tools.deltafeed import DELTA_MANIFEST, export_delta

    if args.rows_per_file is not None:
        raise UsageError("--rows-per-file does not apply to a delta feed (--since): it writes one file per table")
    m = export_delta(args.since, args.ckpt, args.out_dir, args.tables, row_group_rows=args.row_group_rows)
    print(f"delta feed {m['old']['source']} (step {m['old']['step']}) -> {m['new']['source']} "
          f"(step {m['new']['step']}) in {args.out_dir}")
    for name, t in sorted(m["tables"].items()):
        print(f"  {name}: {t['upserts']} upsert(s), {t['deletes']} delete(s), {_human(t['files'][0]['size'])}")
    print(f"manifest {get_storage(args.out_dir).join(args.out_dir, DELTA_MANIFEST)}")
    return EXIT_OK


# ------------------------------------------------------------------------------- export-serving
def _serving_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory, or output dir (its latest checkpoint)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output dir of the serving checkpoint (<OUT_DIR>/<id>, "
                                                      "listed in <OUT_DIR>/checkpoint)")
    p.add_argument("--dtype", default="int8", choices=["int8", "fp16", "bf16", "fp32"],
                   help="how rows are stored (default: int8, per-row scale and offset)")
    p.add_argument("--scale-dtype", default="float16", choices=["float16", "float32"],
                   help="dtype of the int8 rows' scale and offset (default: float16)")
    p.add_argument("--tables", type=_name_list, default=None, metavar="A,B",
                   help="comma-separated tables to export (default: all)")


@command("export-serving", "write a checkpoint's embeddings (int8 / fp16 / bf16 / fp32) and dense "
                           "params as a serving checkpoint", _serving_arguments)
def _export_serving(args: argparse.Namespace) -> int:
    from recsave.format import index as index_mod
    from recsave.tools.serving import export_serving

    path = export_serving(args.ckpt, args.out_dir, args.dtype, args.tables, scale_dtype=args.scale_dtype)
    index = index_mod.read(path)
    print(f"exported {args.dtype} serving checkpoint {path} (step {index.step}, {_human(index.total_bytes)})")
    for name, t in sorted((index.meta.tables if index.meta is not None else {}).items()):
        nbytes = sum(e.nbytes for n, e in index.tensors.items() if n.partition("@")[0] == name)
        print(f"  {name}: {t.rows} rows, dim {t.dim}, {_human(nbytes)}")
    return EXIT_OK


# ------------------------------------------------------------------------- ls / inspect / verify / gc
def _json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout instead of text (shapes in docs/API.md)")


def _output_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="a Saver's output_dir (local path or fsspec URL)")
    _json_argument(p)


def _ckpt_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint directory, or output dir (its latest checkpoint)")
    _json_argument(p)


def _print_json(doc: Dict[str, Any]) -> None:
    print(json.dumps(doc, indent=1, sort_keys=True))


def _age(seconds: Optional[float]) -> str:
    if seconds is None:  # created_at is not a UTC time
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@command("ls", "list the committed checkpoints of an output dir (step, size, age)", _output_dir_argument)
def _ls(args: argparse.Namespace) -> int:
    from recsave.tools.catalog import list_output_dir

    listing = list_output_dir(args.output_dir, "ls")
    entries = listing.checkpoints
    # A listed id gone or damaged, a listed delta whose chain lost a member, or a directory with a
    # damaged index that a rebuilt list left out (repair exits 1 for it too) is damage found
    # (exit 1); one a newer recsave wrote, or with an index over max_index_bytes here, is not.
    code = EXIT_DAMAGED if listing.damaged else EXIT_OK
    if args.json:
        _print_json({"output_dir": args.output_dir, "checkpoints": entries, "left_out": listing.left_out})
        return code
    if not entries:
        print(f"{args.output_dir}: no committed checkpoint")
        _print_left_out(args.output_dir, listing.left_out)
        return code
    print(f"{'checkpoint':24} {'step':>10} {'size':>11} {'age':>8}  {'created':27}  kept because")
    for e in entries:
        hint = f"; `recsave repair {args.output_dir}` drops or names it" if e["damaged"] else ""
        if e["bytes"] is None:  # its index cannot be read
            print(f"{e['id']:24} {'?':>10} {'?':>11} {'?':>8}  {'?':27}  {e['problem']}{hint}")
            continue
        step = "-" if e["step"] is None else str(e["step"])
        # A delta whose chain is broken: the problem in place of why it is kept.
        kept = (', '.join(e['kept']) or '-') if e["problem"] is None else f"{e['problem']}{hint}"
        print(f"{e['id']:24} {step:>10} {_human(e['bytes']):>11} {_age(e['age_s']):>8}  {e['created_at']:27}  "
              f"{kept}")
    _print_left_out(args.output_dir, listing.left_out)
    return code


def _print_left_out(output_dir: str, left_out: List[Dict[str, Any]]) -> None:
    """The directories a rebuilt list left out, one line each, as `recsave repair` names them."""
    for e in left_out:
        hint = f"; `recsave repair {output_dir}` names it" if e["damaged"] else ""
        print(f"left out {e['id']}: {e['problem']}{hint}")


@command("inspect", "describe a checkpoint: tables, rows, dims, slots, shards, dense keys", _ckpt_argument)
def _inspect(args: argparse.Namespace) -> int:
    from recsave.tools.catalog import describe

    d = describe(args.ckpt, tool="inspect")
    # A file the index lists that is gone is damage of this checkpoint (exit 1), as verify and
    # every command reading that file find it; "no such checkpoint" (exit 2) is for a path with none.
    code = EXIT_DAMAGED if d["missing"] else EXIT_OK
    if args.json:
        _print_json(d)
        return code
    kind = "" if d["kind"] == "full" else f" ({d['kind']})"
    seal = "" if d["sealed"] else " (index not sealed: written before recsave sealed its indexes)"
    print(f"{d['path']}: step {d['step']}, {d['world_size']} rank(s), format {d['format_version']}{kind}, "
          f"written by recsave {d['recsave_version']} at {d['created_at']}, {_human(d['bytes'])}{seal}")
    if d["parent"] is not None:
        print(f"{d['kind']} of {d['parent']['id']}; chain (base first): {' <- '.join(d['chain'])}")
    print(f"tables ({len(d['tables'])}):")
    for name, t in sorted(d["tables"].items()):
        dead = f", {t['tombstones']} tombstone(s)" if d["parent"] is not None else ""
        print(f"  {name}: {t['rows']} rows{dead}, dim {t['dim']} {t['dtype']}, slots "
              f"{', '.join(t['slots']) or '-'}, {_human(t['bytes'])}")
    print(f"shards: {d['shards']['files']} file(s), {_human(d['shards']['bytes'])}")
    print(f"dense ({len(d['dense'])}): {', '.join(d['dense']) or '-'}")
    print(f"extras: {', '.join(d['extras']) or '-'}; io states: {', '.join(d['io_states']) or '-'}")
    for path in d["missing"]:
        print(f"MISSING  {path}: listed in the index; the checkpoint is incomplete — restore from another checkpoint")
    return code


@command("verify", "check every file and checksum of a checkpoint (exit 0 intact, 1 damaged)", _ckpt_argument)
def _verify(args: argparse.Namespace) -> int:
    from recsave.tools.catalog import verify
    from recsave.tools.progress import Progress

    bar: List[Progress] = []
    with contextlib.ExitStack() as stack:  # the bar, once verify knows the total, is closed on the way out
        problems = verify(args.ckpt, progress=lambda n: bar[0].advance(n),
                          on_start=lambda total: bar.append(stack.enter_context(
                              Progress("verify", total, unit=" MB", scale=1e6))))
    if args.json:
        _print_json({"path": args.ckpt, "ok": not problems, "problems": problems})
        return EXIT_OK if not problems else EXIT_DAMAGED
    for p in problems:
        print(f"BAD  {' '.join(p.split())}")
    print(f"{args.ckpt}: " + ("all checksums match" if not problems else f"{len(problems)} problem(s)"))
    return EXIT_OK if not problems else EXIT_DAMAGED


def _compact_arguments(p: argparse.ArgumentParser) -> None:
    _ckpt_argument(p)
    p.add_argument("out_dir", metavar="OUT_DIR", help="output dir to write the full checkpoint into (same id)")


@command("compact", "write a (delta) checkpoint's merged state as a full checkpoint into another output dir",
         _compact_arguments)
def _compact(args: argparse.Namespace) -> int:
    from recsave.tools.compact import compact

    path = compact(args.ckpt, args.out_dir)
    if args.json:
        _print_json({"path": path})
    else:
        print(f"wrote {path}")
    return EXIT_OK


def _gc_arguments(p: argparse.ArgumentParser) -> None:
    _output_dir_argument(p)
    p.add_argument("--remove-broken", action="store_true",
                   help="also remove unlisted delta checkpoints whose chain is broken (a member gone, damaged or "
                        "saved again: what `recsave repair` leaves out); kept and named otherwise")


@command("gc", "remove uncommitted leftovers and stray temporary files of crashed saves from an output dir "
              "(and abort the S3 uploads they left unfinished)",
         _gc_arguments)
def _gc(args: argparse.Namespace) -> int:
    from recsave.tools.catalog import clean_output_dir

    done = clean_output_dir(args.output_dir, remove_broken=args.remove_broken)
    if args.json:
        _print_json({"output_dir": args.output_dir, **done})
        return EXIT_OK
    removed, temps, broken = done["removed_checkpoints"], done["removed_temp_files"], done["kept_broken"]
    print(f"removed {len(removed)} director{'y' if len(removed) == 1 else 'ies'}" +
          (f": {', '.join(removed)}" if removed else ""))
    if temps:
        print(f"removed {len(temps)} temporary file(s): {', '.join(temps)}")
    if done["aborted_uploads"]:
        print(f"aborted {len(done['aborted_uploads'])} unfinished upload(s): {', '.join(done['aborted_uploads'])}")
    if broken:
        print(f"kept {len(broken)} delta checkpoint(s) whose chain is broken: {', '.join(broken)}; "
              f"`recsave gc --remove-broken {args.output_dir}` removes them")
        for name, why in broken.items():
            print(f"  kept {name}: {' '.join(why.split())}")
    return EXIT_OK


@command("repair", "rebuild a lost or garbled 'checkpoint' file from the checkpoints' indexes "
                   "(exit 0 fine or rebuilt, 1 something damaged left out)", _output_dir_argument)
def _repair(args: argparse.Namespace) -> int:
    from recsave.tools.catalog import repair

    r = repair(args.output_dir)
    code = EXIT_FAILURE if r["stale"] or r["left_out"] else EXIT_OK
    if args.json:
        _print_json(r)
        return code
    ids = ", ".join(r["ids"]) or "none"
    if r["problem"] is None and code == EXIT_OK:
        print(f"{r['file']}: fine, lists {len(r['ids'])} checkpoint(s): {ids}")
        return EXIT_OK
    how = ("rebuilt from the indexes" if r["rebuilt"] else "rewrote it without them" if r["rewritten"]
           else "left as it is, nothing to rebuild it from")
    print(f"{r['file']}: {r['problem'] or 'fine'}; {how}: {ids}")
    if r["stale"]:
        print(f"  dropped {', '.join(r['stale'])}: directory or index gone")
    for name, why in r["left_out"].items():
        print(f"  left out {name}: {' '.join(why.split())}")
    return code


# ----------------------------------------------------------------------------------- convert
def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="recsave checkpoint or output dir (its latest), torch.save file, "
                                              "DCP directory, or Parquet export")
    p.add_argument("dst", metavar="DST", help="the torch.save file, DCP directory, or output dir to write")
    p.add_argument("--to", required=True, choices=("recsave", "torch", "dcp"), help="what to write")
    p.add_argument("--tables", type=_name_list, default=None, metavar="A,B",
                   help="torch.save / DCP sources: the tensors that are tables (default: <name>.weight with "
                        "<name>.ids beside it, or 2-D without <name>.bias)")
    p.add_argument("--ckpt-id", default=None, metavar="ID", help="--to recsave: checkpoint id (default: converted)")


@command("convert", "convert between recsave checkpoints, torch.save state dicts and DCP directories",
         _convert_arguments)
def _convert(args: argparse.Namespace) -> int:
    from recsave.tools.convert import convert

    written = convert(args.src, args.dst, args.to, tables=args.tables, ckpt_id=args.ckpt_id)
    print(f"converted {args.src} to {args.to}: {written}")
    return EXIT_OK


# -------------------------------------------------------------------------------------- main
class _RaisingParser(argparse.ArgumentParser):
    """argparse, with a usage error raised as UsageError instead of printed and exited on, so that
    main() reports it as it reports any other (also as a JSON document with --json)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.json_commands: Set[str] = set()  # build_parser's: the commands that have --json

    def error(self, message: str) -> Any:  # argparse's NoReturn, widened for mypy's override check
        self.print_usage(sys.stderr)
        command = self.prog.partition(" ")[2]  # "recsave ls" -> "ls"; main() adds "recsave: error: "
        raise UsageError(f"{command}: {message}" if command else message)


def build_parser(*, raise_usage_errors: bool = False) -> argparse.ArgumentParser:
    """The `recsave` argument parser. A usage error exits with status 2 after printing the usage,
    as argparse does, unless `raise_usage_errors` (main's) makes it raise UsageError."""
    cls = _RaisingParser if raise_usage_errors else argparse.ArgumentParser
    parser = cls(prog="recsave", description="Inspect and convert recsave checkpoints.")
    parser.add_argument("--version", action="version", version=f"recsave {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=cls)
    sub.required = True
    json_commands = set()
    for name, (help_text, arguments, handler) in sorted(_COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text)
        arguments(p)
        p.set_defaults(handler=handler)
        if p.get_default("json") is not None:
            json_commands.add(name)
    if isinstance(parser, _RaisingParser):
        parser.json_commands = json_commands
    return parser


def _asks_for_json(parser: _RaisingParser, argv: List[str]) -> bool:
    """Whether a command line that did not parse asked for --json (spelt out or abbreviated, as
    argparse accepts it) of a command that has that option."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in parser.json_commands and any(len(a) > 3 and "--json".startswith(a) for a in argv)


def _error(args: argparse.Namespace, exc: BaseException, message: str, code: int) -> int:
    """Prints the one-line message on stderr (and with --json the error document on stdout)."""
    message = " ".join(str(message).split())
    if getattr(args, "json", False):
        _print_json({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}})
    print(f"recsave: error: {message}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """A warning a command meets (a rebuilt `checkpoint` list, a dropped stale id) is one line on
    stderr, `recsave: warning: <message>`, as errors are: not Python's file:line and source line."""
    def one_line(message: Any, category: Any, filename: str, lineno: int, line: Any = None) -> str:
        return f"recsave: warning: {' '.join(str(message).split())}\n"

    # The format, not showwarning: a caller's catch_warnings(record=True) or logging.captureWarnings
    # still receives the warnings (they format them this way).
    with warnings.catch_warnings():
        warnings.formatwarning = one_line
        yield


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line; returns the exit code (0 ok, 1 damage found, 2 usage error / not
    found / other recsave error, 3 I/O error, 4 unexpected error, 130 interrupted)."""
    parser = cast(_RaisingParser, build_parser(raise_usage_errors=True))
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0), already printed
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_ERROR)
    except UsageError as exc:  # the arguments did not parse: --json is taken as given
        return _error(argparse.Namespace(json=_asks_for_json(parser, argv)), exc, str(exc), EXIT_ERROR)
    try:
        with _warnings_as_lines():
            return int(args.handler(args) or EXIT_OK)
    except OverLimitError as exc:  # an index over max_index_bytes here: maybe intact, not damage found
        return _error(args, exc, str(exc), EXIT_ERROR)
    except CorruptCheckpointError as exc:
        return _error(args, exc, str(exc), EXIT_DAMAGED)
    except StorageError as exc:
        return _error(args, exc, str(exc), EXIT_IO)
    except RecsaveError as exc:
        return _error(args, exc, str(exc), EXIT_ERROR)
    except OSError as exc:
        return _error(args, exc, f"{exc.filename + ': ' if getattr(exc, 'filename', None) else ''}"
                                 f"{exc.strerror or exc}", EXIT_IO)
    except KeyboardInterrupt as exc:
        return _error(args, exc, "interrupted", EXIT_INTERRUPTED)
    except Warning as exc:  # a warning made an error (python -W error): reported as errors are
        return _error(args, exc, f"{type(exc).__name__}: {' '.join(str(exc).split())}", EXIT_ERROR)
    except Exception as exc:  # Python's own exit status 1 would read as "damage found"
        traceback.print_exc(file=sys.stderr)
        return _error(args, exc, f"unexpected {type(exc).__name__}: {' '.join(str(exc).split())} (a recsave bug or "
                                 f"an error it does not know; the traceback is above: please report it)",
                      EXIT_UNEXPECTED)


if __name__ == "__main__":
    sys.exit(main())
