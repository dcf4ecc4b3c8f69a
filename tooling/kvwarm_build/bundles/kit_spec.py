"""A kit file: what a known host lacks that a few paths of vLLM need, and nothing else.

A bundle carries every dependency a host lacks; a host that takes a few files per transfer
needs less. A kit file (TOML, bundle/kits/NAME.toml) names the host's `pip freeze`, the
patched wheel's requirements the kit carries (`[carry]`, each with where its paths import
it) and those it leaves out (`[leave]`, each with why that is safe: the settings in
`[settings]` keep those imports off the paths). What a carried wheel needs in turn is
carried too, unless the host has it or `[leave]` names it.

`plan_kit` holds the file against pip's plan for the host (bundle_resolve.resolve): every
requirement the target's markers select must be the host's, carried, or left with a
reason, and no entry of the file may be stale. Versions are pip's, never the file's.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from ..errors import BuildError
from .resolve import Wheel

DEFAULT_PART_MIB = 60
DEFAULT_MAX_PARTS = 6
_KEYS = {"have", "python_version", "platforms", "part_mib", "max_parts", "carry", "leave", "settings", "check"}


@dataclass(frozen=True)
class KitSpec:
    path: Path
    have: Path  # the host's `pip freeze`
    python_version: str
    platforms: tuple[str, ...]
    part_mib: int
    max_parts: int
    carry: dict[NormalizedName, str]  # the root's requirements carried: name -> where its paths import it
    leave: dict[NormalizedName, str]  # requirements left out: name -> why that is safe
    env: dict[str, str]  # what keeps the left-out packages off the paths (exported by the installer)
    engine_args: tuple[str, ...]  # the same, as engine arguments for every engine the kit runs
    additional_config: dict  # the same, as --additional-config keys
    check_imports: tuple[str, ...]  # what the offline check imports
    check_skip: frozenset[NormalizedName]  # host packages the check's venv leaves out (never imported)

    def settings(self) -> dict:
        return {"env": self.env, "engine_args": list(self.engine_args), "additional_config": self.additional_config}


def _table(data: dict, key: str, where: Path) -> dict[NormalizedName, str]:
    table = data.get(key, {})
    bad = [name for name, why in table.items() if not isinstance(why, str) or not why.strip()]
    if not isinstance(table, dict) or bad:
        raise BuildError(
            f"{where}: [{key}] entries {bad} give no reason",
            'write each as name = "why", e.g. pydantic = "vllm.config"',
        )
    return {canonicalize_name(name): why.strip() for name, why in table.items()}


def read_kit(path: Path) -> KitSpec:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise BuildError(
            f"cannot read the kit file {path}: {err}", "give a TOML kit file (bundle/kits/*.toml)"
        ) from None
    unknown = sorted(set(data) - _KEYS)
    if unknown or "have" not in data:
        raise BuildError(
            f"{path}: unknown keys {unknown} or no `have`",
            f"a kit file holds {', '.join(sorted(_KEYS))}; `have` is the host's pip freeze",
        )
    carry, leave = _table(data, "carry", path), _table(data, "leave", path)
    both = sorted(set(carry) & set(leave))
    if both:
        raise BuildError(f"{path}: {both} both carried and left out", "keep each name in one of [carry] and [leave]")
    settings, check = data.get("settings", {}), data.get("check", {})
    spec = KitSpec(
        path=path,
        have=(path.parent / data["have"]).resolve(),
        python_version=str(data.get("python_version", "3.12")),
        platforms=tuple(data.get("platforms", ["manylinux_2_35_x86_64"])),
        part_mib=int(data.get("part_mib", DEFAULT_PART_MIB)),
        max_parts=int(data.get("max_parts", DEFAULT_MAX_PARTS)),
        carry=carry,
        leave=leave,
        env={str(k): str(v) for k, v in settings.get("env", {}).items()},
        engine_args=tuple(str(a) for a in settings.get("engine_args", [])),
        additional_config=dict(settings.get("additional_config", {})),
        check_imports=tuple(check.get("imports", [])),
        check_skip=frozenset(canonicalize_name(n) for n in check.get("skip_host", [])),
    )
    if spec.part_mib < 1 or spec.max_parts < 1:
        raise BuildError(f"{path}: part_mib {spec.part_mib}, max_parts {spec.max_parts}", "give sizes of 1 or more")
    if not spec.have.is_file():
        raise BuildError(
            f"{path}: the host's freeze file {spec.have} is missing", "fix `have` (relative to the kit file)"
        )
    return spec


@dataclass
class KitPlan:
    """What the kit carries and why; what it leaves to the host or out."""

    wheels: dict[NormalizedName, Wheel] = field(default_factory=dict)
    why: dict[NormalizedName, str] = field(default_factory=dict)  # carried name -> reason
    left_to_host: dict[NormalizedName, str] = field(default_factory=dict)  # name -> the host's version
    left_out: dict[NormalizedName, str] = field(default_factory=dict)  # name -> reason
    replaced: dict[NormalizedName, str] = field(default_factory=dict)  # name -> "host's -> carried"


def _selected(req: Requirement, environment: dict[str, str], extras: tuple[str, ...]) -> bool:
    return req.marker is None or any(req.marker.evaluate({**environment, "extra": e}) for e in ("", *extras))


def plan_kit(
    spec: KitSpec,
    root: Wheel,
    candidates: dict[NormalizedName, Wheel],
    have: dict[NormalizedName, Version],
    environment: dict[str, str],
) -> KitPlan:
    """The kit for `root` from pip's `candidates` (what pip would install on the host);
    a BuildError lists every requirement the file does not account for, and stale entries."""
    plan, problems, used = KitPlan(), [], set()
    plan.wheels[root.name] = root
    queue, seen = [(root, ())], {(root.name, ())}
    while queue:
        wheel, extras = queue.pop()
        for req in wheel.requires:
            if not _selected(req, environment, extras):
                continue
            name = canonicalize_name(req.name)
            host = have.get(name)
            if host is not None and req.specifier.contains(host, prereleases=True):
                plan.left_to_host[name] = str(host)
                continue
            if name in spec.leave:
                used.add(name)
                plan.left_out[name] = spec.leave[name]
                continue
            if wheel is root and name not in spec.carry:
                problems.append(
                    f"{req} (the host has {host or 'none'}): add it to [carry] with where it is "
                    "imported, or to [leave] with why that is safe"
                )
                continue
            found = candidates.get(name)
            if found is None or not req.specifier.contains(found.version, prereleases=True):
                problems.append(f"{req}, needed by {wheel.name}: pip's plan has no version of it for the host")
                continue
            used.add(name)
            plan.wheels[name] = found
            plan.why.setdefault(name, spec.carry.get(name) or f"required by {wheel.name}")
            if host is not None:
                plan.replaced[name] = f"{host} -> {found.version}"
            key = (name, tuple(sorted(req.extras)))
            if key not in seen:
                seen.add(key)
                queue.append((found, key[1]))
    stale = sorted((set(spec.carry) | set(spec.leave)) - used)
    if stale:
        problems.append(
            f"{', '.join(stale)}: named in the kit file, yet nothing left to carry requires them "
            "(or the host has them): remove them"
        )
    if problems:
        raise BuildError(
            f"the kit file {spec.path} does not match what the host needs:\n  - " + "\n  - ".join(problems),
            "edit the kit file (docs/gpu-smoke.md says how its lists were found)",
        )
    return plan
