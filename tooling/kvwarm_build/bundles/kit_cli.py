"""`kvwarm-build kit`, `kit-check` and `kit-host-python`: the kit for a known host
(kit.py), its offline install on the host's package set (kit_check.py), and that set's
Python for a dry run on CPU. The command line (cli.py) resolves the release's patched wheel
and the cache and passes them in: a room imports no command."""

from __future__ import annotations

from pathlib import Path

from .. import project
from ..errors import BuildError
from .kit_spec import read_kit
from .make import index_options

DEFAULT_OUT = project.ROOT / ".kit"


def _log(message: str) -> None:
    print(f"[kvwarm-build] {message}", flush=True)


def cmd_kit(args, wheel: Path, record: dict) -> int:
    from .kit import carry_paths, make_kit

    spec = read_kit(args.kit)
    if record["flavour"] != "cuda":
        raise BuildError(f"a kit carries the cuda flavour, not {record['flavour']}", "drop --flavour")
    pip_args = index_options(args.index_url, args.find_links, args.no_index)
    manifest = make_kit(wheel, record, spec, args.out, pip_args, log=_log)
    try:
        shown = [Path(p).relative_to(project.ROOT).as_posix() for p in carry_paths(args.out.resolve(), manifest)]
    except ValueError:  # a kit outside the repository: carried from a copy at .kit/
        shown = carry_paths(Path(".kit"), manifest)
    _log("carry, one per device call, back to back: " + " ".join(shown))
    return 0


def cmd_kit_check(args, cache: Path) -> int:
    from .kit_check import check_kit

    check_kit(read_kit(args.kit), args.dir, cache, python=args.python, log=_log)
    return 0


def cmd_kit_host_python(args, cache: Path) -> int:
    from .kit_check import find_python, host_venv

    spec = read_kit(args.kit)
    print(host_venv(spec, cache, find_python(spec, args.python), log=_log))
    return 0


def add_commands(sub, with_release, patched_wheel, cache) -> None:
    """The kit's subcommands on kvwarm-build's parser; patched_wheel(args) gives the release's
    patched wheel and its build record, cache(args) the cache folder."""
    kit_help = "the kit file (bundle/kits/*.toml)"
    k = with_release(
        "kit",
        lambda args: cmd_kit(args, *patched_wheel(args)),
        "the smallest kit for a known host: the patched wheel and what the kit file carries, "
        "in part folders p1..pN of bounded size, with manifest.json and install.py in each",
        flavour=True,
    )
    k.add_argument("--kit", type=Path, required=True, help=kit_help)
    k.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the kit folder (default: .kit, what device calls carry)"
    )
    k.add_argument("--index-url", help="pip's index (default: pip's own configuration)")
    k.add_argument("--find-links", action="append", default=[], help="a folder of wheels for pip, repeatable")
    k.add_argument("--no-index", action="store_true", help="only --find-links folders")
    c = sub.add_parser("kit-check", help="install a kit offline on the host's package set, selfcheck, import its paths")
    c.add_argument("--kit", type=Path, required=True, help=kit_help)
    c.add_argument("--dir", type=Path, default=DEFAULT_OUT, help="the kit folder (default: .kit)")
    c.add_argument("--python", help="the host's Python version here (default: pythonX.Y of the kit file)")
    c.set_defaults(func=lambda args: cmd_kit_check(args, cache(args)))
    h = sub.add_parser("kit-host-python", help="print the Python of a venv holding the host's package set")
    h.add_argument("--kit", type=Path, required=True, help=kit_help)
    h.add_argument("--python", help="the host's Python version here (default: pythonX.Y of the kit file)")
    h.set_defaults(func=lambda args: cmd_kit_host_python(args, cache(args)))
