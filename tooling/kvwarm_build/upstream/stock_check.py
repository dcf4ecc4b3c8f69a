"""Tests on the stock wheel: series tests must fail there, stock tests must pass.

A release's `series_tests` (releases.toml) pass on the patched build only because of its
series. Running them on the official wheel and seeing each one fail proves that, and
catches a test that would pass anyway (one that checks nothing the series adds). Its
`stock_tests` must pass on the official wheel as well: a parity suite for a backport is
checked there against the upstream code it copies.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from .. import project
from ..errors import BuildError
from ..fetch import fetch
from ..releases import Release
from ..venvs.deps import ensure_deps_venv, ensure_layered_venv
from .suite import parse_junit

_TOOLS = ["pytest", "hypothesis"]


def stock_venv(release: Release, cache: Path, log) -> Path:
    wheel = fetch(release.flavour("cuda").wheel, cache / "downloads", log=log)
    return ensure_layered_venv(
        cache / "venvs" / f"stock-{release.version}-cuda",
        ensure_deps_venv(release, cache, log=log),
        [_TOOLS, ["--no-deps", str(wheel)]],
        log=log,
    )


def _outcomes_on_stock(release: Release, files: list[str], cache: Path, log) -> dict[str, str]:
    python = stock_venv(release, cache, log)
    with tempfile.TemporaryDirectory(prefix="kvwarm-stock-") as tmp:
        junit = Path(tmp) / "stock.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
        # The test support reaches the stock venv by path, as it reaches the official build's
        # in the smoke: the tests' conftest imports it.
        paths = [str(project.TEST_SUPPORT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, **release.scheduler_env, "PYTHONPATH": os.pathsep.join(paths)}
        if not release.cpu_platform:
            env.pop("VLLM_TARGET_DEVICE", None)
        run = subprocess.run(cmd, cwd=project.ROOT, env=env, capture_output=True, text=True, check=False)
        if not junit.exists():
            raise BuildError(
                f"pytest on stock {release.version} left no report:\n{run.stdout[-2000:]}",
                "check the series_tests and stock_tests paths in releases.toml",
            )
        return parse_junit(junit)


def _of_file(results: dict[str, str], file: str) -> dict[str, str]:
    """The results of one test file (junit classnames are dotted module paths)."""
    module = file.removesuffix(".py").replace("/", ".")
    return {t: s for t, s in results.items() if t.split("::")[0] == module or t.startswith(module + ".")}


def file_problems(file: str, outcomes: dict[str, str], must_fail: bool) -> list[str]:
    """A series test file must fail on stock test by test (a skip is a skip, not the failure
    that proves the series); a stock test file must pass, where a skip is no failure but at
    least one test has to pass."""
    if not outcomes:
        return [f"{file}: no test ran"]
    if must_fail:
        return [
            f"{t}: {s} on stock, but it must fail there" + (" (a skip proves nothing)" if s == "skipped" else "")
            for t, s in sorted(outcomes.items())
            if s not in ("failed", "error")
        ]
    problems = [
        f"{t}: {s} on stock, but it must pass there" for t, s in sorted(outcomes.items()) if s in ("failed", "error")
    ]
    if "passed" not in outcomes.values():
        problems.append(f"{file}: every test skipped on stock; none passed")
    return problems


def check_tests_on_stock(release: Release, cache: Path, log=print) -> int:
    files = [*release.series_tests, *release.stock_tests]
    if not files:
        log(f"release {release.version} lists no series_tests or stock_tests")
        return 0
    log(
        f"on stock {release.version}: series tests must fail ({' '.join(release.series_tests) or '-'}), "
        f"stock tests must pass ({' '.join(release.stock_tests) or '-'})"
    )
    results = _outcomes_on_stock(release, files, cache, log)
    problems = []
    for file in files:
        problems += file_problems(file, _of_file(results, file), must_fail=file in release.series_tests)
    if problems:
        print(f"stock {release.version}:\n  " + "\n  ".join(problems), flush=True)
        return 1
    skipped = sum(s == "skipped" for s in results.values())
    print(
        f"stock {release.version}: {len(results)} test(s) as expected "
        f"(series tests fail, stock tests pass; {skipped} skipped)",
        flush=True,
    )
    return 0
