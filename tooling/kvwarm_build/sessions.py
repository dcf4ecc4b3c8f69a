"""Which nox sessions the release table gives, and the arguments sessions take.

noxfile.py registers what this module says, so "a release is a table row plus a series"
can be tested here without nox: a release row gets the scheduler-side tiers; a row with a
cpu flavour also gets the CPU engine tiers.
"""

from __future__ import annotations

import argparse

from .errors import BuildError
from .releases import Release

# Per release, in the order `tests` runs them; the CPU engine tiers need a cpu flavour.
CI_KINDS = ("upstream-tests", "unit", "engine", "smoke-cpu")
CPU_ENGINE_KINDS = frozenset({"engine", "smoke-cpu"})


def kinds(release: Release) -> list[str]:
    """The CI session kinds this release gets."""
    return [k for k in CI_KINDS if k not in CPU_ENGINE_KINDS or release.cpu_tier_missing is None]


def ci_sessions(releases: list[Release]) -> list[str]:
    """What `nox -s tests` runs after the tooling tests: lint, the builds (checked for
    reproducibility), then each kind for every release that has it."""
    names = ["lint-patches", *(f"build-{r.short}" for r in releases)]
    for kind in CI_KINDS:
        names += [f"{kind}-{r.short}" for r in releases if kind in kinds(r)]
    return names


def missing_tiers(releases: list[Release]) -> list[str]:
    """One line per release that lacks a tier, saying why."""
    return [r.cpu_tier_missing for r in releases if r.cpu_tier_missing]


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
