"""`kvwarm-build` (also `python -m kvwarm_build`): the commands the nox sessions run."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from . import project
from .builds.build import check_reproducible, ensure_built, output_name
from .builds.maint import export_patches, lint_releases, materialise, write_series
from .builds.series import read_series, series_folder
from .bundles.kit_cli import add_commands as add_kit_commands
from .bundles.resolve import Target
from .errors import BuildError
from .fetch import fetch
from .releases import FLAVOURS, find_release, load_releases
from .venvs.deps import current_python, ensure_deps_venv, install_wheel, layer_on_deps


def _log(message: str) -> None:
    print(f"[kvwarm-build] {message}", flush=True)


def _release(args):
    return find_release(load_releases(args.releases), args.release)


def _cache(args) -> Path:
    return args.cache or project.cache_dir()


def cmd_build(args) -> int:
    release = _release(args)
    wheel = ensure_built(
        release,
        args.flavour,
        _cache(args),
        dist=args.dist,
        if_stale=args.if_stale,
        check=not args.no_validate,
        log=_log,
    )
    if args.check_reproducible:
        check_reproducible(release, args.flavour, _cache(args), wheel, log=_log)
    print(wheel)
    return 0


def cmd_build_all(args) -> int:
    from .builds.build_all import build_all, chosen

    releases = load_releases(args.releases)
    checked = {find_release(releases, name).short for name in args.check_reproducible}
    releases = chosen(releases, args.only, checked)
    options = ["--releases", str(args.releases), "--dist", str(args.dist)]
    build_all(releases, args.jobs, checked, options + (["--cache", str(args.cache)] if args.cache else []))
    return 0


def cmd_install_built(args) -> int:
    """The built wheel into this venv, over whatever vLLM it holds: --no-deps (its
    dependencies come from a layered deps venv), byte-compiled (every test process imports it).
    The release's other flavours go first: each installs the same `vllm` package."""
    from .venvs.installer import uninstall

    release = _release(args)
    wheel = args.dist / output_name(release, args.flavour)
    if not wheel.is_file():
        raise BuildError(f"{wheel} is not built", f"build it first: kvwarm-build build --release {args.release}")
    uninstall(current_python(), *sorted(f.dist for name, f in release.flavours.items() if name != args.flavour))
    install_wheel(current_python(), wheel, _cache(args), log=_log)
    return 0


def cmd_lint(args) -> int:
    releases = load_releases(args.releases)
    # --release: the staleness check (a release wheel each, downloaded once) for those alone
    stale_checked = {find_release(releases, name).version for name in args.release} if args.release else None

    def upstream_of(release):
        if stale_checked is not None and release.version not in stale_checked:
            return None
        return fetch(release.flavour("cuda").wheel, _cache(args) / "downloads", log=_log)

    problems = lint_releases(releases, project.PATCHES, None if args.no_staleness else upstream_of, log=_log)
    for problem in problems:
        print(f"lint-patches: {problem}")
    return 1 if problems else 0


def _work_tree(args, release) -> Path:
    return args.tree or project.ROOT / "work" / f"vllm-{release.version}"


def cmd_materialise(args) -> int:
    release = _release(args)
    upstream = fetch(release.flavour("cuda").wheel, _cache(args) / "downloads", log=_log)
    series = read_series(series_folder(project.PATCHES, release.version))
    tree = _work_tree(args, release)
    tree.parent.mkdir(parents=True, exist_ok=True)
    materialise(upstream, series, tree, force=args.force, log=_log)
    return 0


def cmd_export(args) -> int:
    release = _release(args)
    dest = series_folder(project.PATCHES, release.version)
    patches = export_patches(_work_tree(args, release))
    write_series(dest, patches)
    _log(f"exported {len(patches)} patch(es) into {dest}")
    return 0


def cmd_layer_deps(args) -> int:
    layer_on_deps(current_python(), ensure_deps_venv(_release(args), _cache(args), log=_log))
    return 0


def cmd_layer_engine_deps(args) -> int:
    from .venvs.engine import ensure_engine_deps

    layer_on_deps(current_python(), ensure_engine_deps(_release(args), _cache(args), log=_log))
    return 0


def cmd_stock_engine_python(args) -> int:
    from .venvs.engine import stock_engine_venv

    print(stock_engine_venv(_release(args), _cache(args), log=_log))
    return 0


def cmd_upstream_tests(args) -> int:
    from .upstream.run import run_upstream_tests

    return run_upstream_tests(_release(args), _cache(args), args.dist, full=args.full, log=_log)


def cmd_stock_check(args) -> int:
    from .upstream.stock_check import check_tests_on_stock

    return check_tests_on_stock(_release(args), _cache(args), log=_log)


def cmd_upstream_status(args) -> int:
    from .upstream.status import upstream_status

    versions = [v.strip() for arg in args.release for v in arg.split(",") if v.strip()]
    lines = upstream_status(load_releases(args.releases), project.PATCHES, _cache(args), log=_log, versions=versions)
    for line in lines:
        print(line, flush=True)
    return 0


def _patched_wheel(args, release):
    """The patched wheel (built when stale) and its build record."""
    from .builds.build import read_built_record

    wheel = ensure_built(release, args.flavour, _cache(args), dist=args.dist, if_stale=True, log=_log)
    return wheel, read_built_record(wheel)


def cmd_image(args) -> int:
    from .images.builders import detect_builder
    from .images.dockerfile import build_image

    release = _release(args)
    builder = detect_builder()
    _log(f"image builder: {builder.name}")
    wheel, record = _patched_wheel(args, release)
    base = args.base or release.flavour(args.flavour).image
    tag, _ = build_image(builder, release, wheel, record, base, tag=args.tag, log=_log)
    print(tag)
    return 0


def cmd_image_standin(args) -> int:
    from .images.standin import build_on_standin

    release = _release(args)
    wheel, record = _patched_wheel(args, release)
    build_on_standin(release, wheel, record, _cache(args), flavour=args.flavour, keep=args.keep, log=_log)
    return 0


def cmd_bundle(args) -> int:
    from .bundles.make import index_options, make_bundle

    release = _release(args)
    wheel, record = _patched_wheel(args, release)
    out = args.out or args.dist / f"bundle-{record['version']}-{args.flavour}"
    target = Target(args.python_version, tuple(args.platform or Target.platforms), args.implementation)
    pip_args = index_options(args.index_url, args.find_links, args.no_index)
    make_bundle(wheel, out, args.have, target, args.split_mib, pip_args, log=_log)
    print(out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvwarm-build", description=__doc__)
    p.add_argument("--releases", type=Path, default=project.RELEASES, help="the release table")
    p.add_argument(
        "--cache", type=Path, help="cache for downloads and venvs (default: $KVWARM_CACHE_DIR or .nox/.cache)"
    )
    p.add_argument("--dist", type=Path, default=project.DIST, help="where built wheels go")
    sub = p.add_subparsers(dest="command", required=True)

    def with_release(name, func, help, flavour=False):
        s = sub.add_parser(name, help=help)
        s.add_argument("--release", required=True, help="a version or short name from releases.toml")
        if flavour:
            s.add_argument("--flavour", choices=FLAVOURS, default="cuda")
        s.set_defaults(func=func)
        return s

    b = with_release("build", cmd_build, "build the patched wheel into dist/", flavour=True)
    b.add_argument("--if-stale", action="store_true", help="skip when dist/ has a wheel from the same inputs")
    b.add_argument("--no-validate", action="store_true", help="skip post-build validation (tests only)")
    b.add_argument("--check-reproducible", action="store_true", help="build a second time and compare bytes")
    ba = sub.add_parser("build-all", help="every release's patched cuda wheel, --jobs builds at a time")
    ba.add_argument("--jobs", type=int, default=2, help="builds at once (each mostly one core's work; default 2)")
    ba.add_argument(
        "--check-reproducible",
        action="append",
        default=[],
        metavar="RELEASE",
        help="build this release twice and compare bytes (repeatable)",
    )
    ba.add_argument(
        "--only", action="append", default=[], metavar="RELEASE", help="build only this release (repeatable)"
    )
    ba.set_defaults(func=cmd_build_all)
    with_release("install-built", cmd_install_built, "install the built wheel into this venv (--no-deps)", flavour=True)
    m = with_release("materialise", cmd_materialise, "pristine tree + series as commits in a git repo")
    m.add_argument("--tree", type=Path, help="default: work/vllm-X.Y.Z")
    m.add_argument("--force", action="store_true", help="recreate the tree, discarding its commits")
    e = with_release("export", cmd_export, "re-export the tree's commits into patches/vllm-X.Y.Z")
    e.add_argument("--tree", type=Path, help="default: work/vllm-X.Y.Z")
    with_release("layer-deps", cmd_layer_deps, "make this venv see the release's vLLM dependency venv")
    with_release(
        "layer-engine-deps", cmd_layer_engine_deps, "make this venv see the release's CPU engine dependency venv"
    )
    with_release(
        "stock-engine-python",
        cmd_stock_engine_python,
        "print the python of a venv with the official cpu wheel on the engine venv (made if missing)",
    )
    ut = with_release("upstream-tests", cmd_upstream_tests, "vLLM's own CPU tests: stock vs patched")
    ut.add_argument(
        "--full",
        action="store_true",
        help="keep the stress cases in (minutes; when a release is added or its build bumped)",
    )
    with_release("stock-check", cmd_stock_check, "on the stock wheel: series_tests must fail, stock_tests pass")
    im = with_release(
        "image", cmd_image, "images/Dockerfile on the official base (docker buildx, podman or buildah)", flavour=True
    )
    im.add_argument("--base", help="base image (default: the flavour's image in releases.toml)")
    im.add_argument("--tag", help="default: <base repository>-kvwarm:vX.Y.Z-kvwarm.N")
    st = with_release(
        "image-standin",
        cmd_image_standin,
        "images/Dockerfile on a local stand-in base with buildah, checked from outside",
        flavour=True,
    )
    st.add_argument("--keep", action="store_true", help="keep the built image (the stand-in base is always kept)")
    bu = with_release(
        "bundle",
        cmd_bundle,
        "a folder for a host without a package index: the patched wheel, "
        "the dependency wheels it lacks, manifest.json and install.py",
        flavour=True,
    )
    bu.add_argument("--out", type=Path, help="default: dist/bundle-<version>-<flavour>")
    bu.add_argument("--have", type=Path, help="`pip freeze` of the target: what it has is left out (default: nothing)")
    bu.add_argument("--split-mib", type=int, help="cut files larger than this into parts of at most this many MiB")
    bu.add_argument(
        "--python-version", default=Target.python_version, help="the target's Python (default: %(default)s)"
    )
    bu.add_argument(
        "--platform",
        action="append",
        help=f"the target's wheel platform tag, repeatable (default: {Target.platforms[0]})",
    )
    bu.add_argument("--implementation", default=Target.implementation, help="(default: %(default)s)")
    bu.add_argument("--index-url", help="pip's index (default: pip's own configuration)")
    bu.add_argument("--find-links", action="append", default=[], help="a folder of wheels for pip, repeatable")
    bu.add_argument("--no-index", action="store_true", help="only --find-links folders")
    add_kit_commands(sub, with_release, lambda args: _patched_wheel(args, _release(args)), _cache)
    us = sub.add_parser(
        "upstream-status",
        help="newer vLLM releases on the index: cpu wheel, torch pin, "
        "whether the newest series applies, which series' version of each patch fits "
        "($KVWARM_INDEX_URL, else pip's configured index)",
    )
    us.add_argument(
        "--release",
        action="append",
        default=[],
        help="check this version (X.Y.Z; repeatable or comma-separated) instead of the newer ones",
    )
    us.set_defaults(func=cmd_upstream_status)
    lp = sub.add_parser("lint-patches", help="series <-> files, headers, file names, staleness")
    lp.add_argument("--no-staleness", action="store_true", help="skip the fresh-export comparison")
    lp.add_argument(
        "--release",
        action="append",
        default=[],
        help="compare only this release's series with a fresh export (repeatable; the other checks cover every "
        "release): a port lints its own series without downloading every release wheel",
    )
    lp.set_defaults(func=cmd_lint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except BuildError as err:
        print(f"kvwarm-build: error: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"kvwarm-build: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
