"""upstream-tests-X: vLLM's own CPU tests, stock release against patched build.

Venvs layered on the shared deps venv run the suite with the stock release wheel and with
the patched build of the same flavour. The stock results depend only on the release, the
sdist and the stand-ins, so they are cached by those inputs; when they must be computed,
the two runs go side by side (each is one busy core), their output into log files.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..builds.build import ensure_built
from ..digests import cache_key
from ..errors import BuildError
from ..fetch import fetch, sha256_of
from ..releases import Release
from ..venvs.deps import ensure_deps_venv, ensure_layered_venv, install_wheel
from ..venvs.installer import install
from .hf_standins import seed_hf_cache
from .suite import (
    SITE_FILES,
    TEST_VENV_COMMON,
    TEST_VENV_NO_DEPS,
    compare,
    extract_tests,
    gate,
    gate_env,
    hub_ids,
    prepare_site,
    run_gate,
    torchvision_for,
)

# Files that shape a run besides the wheel and the tests: stand-in recipes, the files
# run_suite puts on PYTHONPATH (shims, fixtures plugin), and the selection itself.
_RUN_INPUTS = [Path(__file__).with_name(n) for n in ("_make_standins.py", *(s for s, _ in SITE_FILES), "suite.py")]


def _torch_in(deps_site: Path) -> str:
    (info,) = deps_site.glob("torch-*.dist-info")
    return info.name.removeprefix("torch-").removesuffix(".dist-info")


def _test_venv(cache: Path, release: Release, deps_site: Path, log, suffix: str = "") -> Path:
    no_deps = [*TEST_VENV_NO_DEPS, torchvision_for(_torch_in(deps_site))]
    return ensure_layered_venv(
        cache / "venvs" / f"upstream-tests-{release.version}{suffix}",
        deps_site,
        [[*release.test_pins, *TEST_VENV_COMMON], ["--no-deps", *no_deps]],
        log=log,
    )


def _stock_key(release: Release, flavour: str, runs, deps_site: Path) -> str:
    return cache_key(
        release.flavour(flavour).wheel.sha256,
        # vLLM's platform (cpu_platform): the same tests give other results on another one.
        sorted(gate_env(release.cpu_platform).items()),
        release.sdist.sha256,
        runs,
        release.test_pins,
        TEST_VENV_COMMON,
        TEST_VENV_NO_DEPS,
        deps_site.parents[2].name,
        [sha256_of(f) for f in _RUN_INPUTS],
        length=16,
    )


def run_upstream_tests(release: Release, cache: Path, dist: Path, full: bool = False, log=print) -> int:
    """`full` adds the stress cases (minutes): for a new release or a bumped build number."""
    flavour = release.test_flavour
    sdist = fetch(release.sdist, cache / "downloads", log=log)
    stock_wheel = fetch(release.flavour(flavour).wheel, cache / "downloads", log=log)
    patched_wheel = ensure_built(release, flavour, cache, dist=dist, if_stale=True, log=log)
    work = cache / "upstream" / release.version
    tests_root = extract_tests(sdist, work / "src")
    runs = gate(tests_root, full=full)
    env = gate_env(release.cpu_platform)
    where = "vLLM's CPU platform" + ("" if release.cpu_platform else ", its x86 Triton refusal lifted")
    log(
        f"vLLM {release.version} own CPU tests on the {flavour} flavour, {where}"
        f" ({'full' if full else 'without the stress cases; --full adds them'}):"
    )
    for run in runs:
        log(f"  {run.name}: {' '.join(run.args)} {len(run.paths)} path(s) under {run.conftest_root}")
    deps_site = ensure_deps_venv(release, cache, log=log)
    python = _test_venv(cache, release, deps_site, log)
    hf_home = cache / "upstream" / "hf"
    seed_hf_cache(hf_home / "hub", hub_ids(tests_root, runs), str(python))

    stock_cache = work / f"stock-{_stock_key(release, flavour, runs, deps_site)}.json"
    if stock_cache.exists():
        stock = json.loads(stock_cache.read_text())
        log(f"stock results reused from {stock_cache}")
        log(f"running on patched {patched_wheel.name}")
        install_wheel(python, patched_wheel, cache, log)
        patched = run_gate(str(python), tests_root, work / "patched", hf_home, runs, platform_env=env)
    else:
        stock_python = _test_venv(cache, release, deps_site, log, suffix="-stock")
        # From uv's cache, as the unit tests' stock venv has it: one unpack of the release
        # wheel on disk.
        install(stock_python, "--no-deps", "--reinstall", str(stock_wheel), log=log)
        install_wheel(python, patched_wheel, cache, log)
        prepare_site(tests_root)
        log(f"running on stock {stock_wheel.name} and patched {patched_wheel.name} side by side")
        with ThreadPoolExecutor(2) as pool:
            stock_run, patched_run = (
                pool.submit(run_gate, str(side), tests_root, work / name, hf_home, runs, True, platform_env=env)
                for side, name in ((stock_python, "stock"), (python, "patched"))
            )
            stock, patched = stock_run.result(), patched_run.result()
        for side in ("stock", "patched"):
            for run in runs:
                log_file = work / f"{side}-{run.slug}.log"
                tail = log_file.read_text().splitlines()[-6:]
                print(f"--- last lines of {log_file}:\n" + "\n".join(tail), flush=True)
        stock_cache.write_text(json.dumps(stock, indent=0, sort_keys=True))
    regressions, report = compare(stock, patched, f"stock {stock_wheel.name}", f"patched {patched_wheel.name}")
    print(report, flush=True)
    if not any(outcome == "passed" for outcome in stock.values()):
        raise BuildError(f"no test passed on stock {release.version}", "the test setup is broken; see the log above")
    return 1 if regressions else 0
