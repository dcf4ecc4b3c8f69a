"""Series tests on the stock wheel: every one must fail there.

A release's `series_tests` (releases.toml) pass on the patched build only because of its
series. Running them on the official wheel and seeing each one fail proves that, and
catches a test that would pass anyway (one that checks nothing the series adds).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from . import project
from .errors import BuildError
from .fetch import fetch
from .releases import Release
from .upstream_tests import parse_junit
from .venvs import ensure_deps_venv, ensure_layered_venv

_TOOLS = ["pytest", "hypothesis"]


def _stock_venv(release: Release, cache: Path, log) -> Path:
    wheel = fetch(release.flavour("cuda").wheel, cache / "downloads", log=log)
    return ensure_layered_venv(
        cache / "venvs" / f"stock-{release.version}-cuda", ensure_deps_venv(cache, log=log),
        [_TOOLS, ["--no-deps", str(wheel)]], log=log,
    )


def check_series_tests_fail_on_stock(release: Release, cache: Path, log=print) -> int:
    if not release.series_tests:
        log(f"release {release.version} lists no series_tests")
        return 0
    python = _stock_venv(release, cache, log)
    with tempfile.TemporaryDirectory(prefix="kvwarm-stock-") as tmp:
        junit = Path(tmp) / "stock.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *release.series_tests]
        log(f"series tests on stock {release.version} (each must fail): {' '.join(release.series_tests)}")
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
        run = subprocess.run(cmd, cwd=project.ROOT, env=env, capture_output=True, text=True)
        if not junit.exists():
            raise BuildError(f"pytest on stock {release.version} left no report:\n{run.stdout[-2000:]}",
                             "check the series_tests paths in releases.toml")
        results = parse_junit(junit)
    passing = sorted(t for t, status in results.items() if status == "passed")
    if not results:
        raise BuildError(f"no series test ran on stock {release.version}", "check series_tests")
    if passing:
        print(f"{len(passing)} series test(s) pass on stock {release.version}, so the series "
              "is not what makes them pass:\n  " + "\n  ".join(passing), flush=True)
        return 1
    print(f"stock {release.version}: all {len(results)} series tests fail, as they must", flush=True)
    return 0
