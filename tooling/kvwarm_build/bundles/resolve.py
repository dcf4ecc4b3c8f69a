"""Which dependency wheels a target host lacks, resolved by pip for that host.

The target is a Python version and platform plus what is already installed there, given as
a `pip freeze` file. pip does the resolving: it runs against a scratch environment whose only
"installed" distributions are stubs of the freeze file's entries (name, version and the
requirements the index lists for them), with the target's --python-version/--platform, so it
plans exactly what the host would still need without breaking what the host's packages pin.
pip judges markers by the interpreter that runs it, not the target's, so the plan is then
walked again with the target's marker environment (packaging): what the target needs and pip
left out is resolved in another round, what only this interpreter needed is dropped.
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
import venv
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from ..errors import BuildError

MIN_PIP = Version("24.1")  # platform options together with --dry-run
ROUNDS = 3  # marker fix-up rounds before giving up


@dataclass(frozen=True)
class Target:
    python_version: str = "3.12"
    platforms: tuple[str, ...] = ("manylinux_2_35_x86_64",)  # glibc of Ubuntu 22.04, vLLM images' base
    implementation: str = "cp"

    @property
    def abi(self) -> str:
        return f"{self.implementation}{self.python_version.replace('.', '')}"

    def pip_options(self) -> list[str]:
        options = [
            "--only-binary=:all:",
            "--python-version",
            self.python_version,
            "--implementation",
            self.implementation,
            "--abi",
            self.abi,
            "--abi",
            "abi3",
            "--abi",
            "none",
        ]
        for platform in self.platforms:
            for tag in _older_manylinux(platform):
                options += ["--platform", tag]
        return options

    def marker_environment(self) -> dict[str, str]:
        """Markers as the target's interpreter evaluates them."""
        machine = re.sub(r"^[a-z]*linux[0-9]*(_[0-9]+_[0-9]+)?_", "", self.platforms[0])
        return {
            **default_environment(),
            "python_version": self.python_version,
            "python_full_version": f"{self.python_version}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
            "platform_machine": machine,
        }


_MANYLINUX = re.compile(r"^manylinux_2_(\d+)_(\w+)$")
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def _older_manylinux(platform: str) -> list[str]:
    """A glibc 2.N platform also runs wheels for every older glibc; pip takes the tags as given."""
    match = _MANYLINUX.match(platform)
    if not match:
        return [platform]
    newest, arch = int(match[1]), match[2]
    tags = []
    for minor in range(newest, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY:
            tags.append(f"{_LEGACY[minor]}_{arch}")
    return tags


def read_have(path: Path) -> dict[NormalizedName, Version]:
    """A `pip freeze` file: `name==version` lines; comments and blank lines are skipped."""
    have = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}: {raw.strip()!r}"
        try:
            req = Requirement(line)
            (spec,) = req.specifier
        except (InvalidRequirement, ValueError):
            raise BuildError(
                f"{where} is not a `name==version` line",
                "write what `pip freeze` prints on the target, one `name==version` a line",
            ) from None
        if spec.operator not in ("==", "===") or "*" in spec.version:
            raise BuildError(f"{where} does not pin one version", "write the installed version as name==X.Y.Z")
        have[canonicalize_name(req.name)] = Version(spec.version)
    return have


@dataclass(frozen=True)
class Wheel:
    """A wheel's distribution name, version and Requires-Dist."""

    name: NormalizedName
    version: Version
    requires: tuple[Requirement, ...]

    @classmethod
    def read(cls, path: Path) -> Wheel:
        with zipfile.ZipFile(path) as zf:
            metadata = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(metadata) != 1:
                raise BuildError(f"{path.name} has {len(metadata)} .dist-info/METADATA files", "use a valid wheel")
            return cls.parse(zf.read(metadata[0]).decode())

    @classmethod
    def parse(cls, text: str) -> Wheel:
        message = email.parser.HeaderParser().parsestr(text)
        requires = tuple(Requirement(r) for r in message.get_all("Requires-Dist") or [])
        return cls(canonicalize_name(message["Name"]), Version(message["Version"]), requires)


@dataclass
class Plan:
    """What the bundle carries (by name) and what the target's own packages satisfy."""

    wheels: dict[NormalizedName, Wheel] = field(default_factory=dict)
    left_out: dict[NormalizedName, str] = field(default_factory=dict)  # name -> the target's version
    replaced: dict[NormalizedName, str] = field(default_factory=dict)  # name -> "target's -> bundled"


def walk(
    root: Wheel,
    candidates: dict[NormalizedName, Wheel],
    have: dict[NormalizedName, Version],
    environment: dict[str, str],
) -> tuple[Plan, list[Requirement]]:
    """From the root, every requirement the target's markers select: satisfied by the target's
    own packages (left out), by a candidate (carried), or by nothing yet (returned)."""
    plan, missing = Plan(), []
    queue, seen = [(root, ())], {(root.name, ())}
    plan.wheels[root.name] = root
    while queue:
        wheel, extras = queue.pop()
        for req in wheel.requires:
            if req.marker and not any(req.marker.evaluate({**environment, "extra": e}) for e in ("", *extras)):
                continue
            name = canonicalize_name(req.name)
            if name in have and req.specifier.contains(have[name], prereleases=True):
                plan.left_out[name] = str(have[name])
                continue
            found = candidates.get(name)
            if found is None or not req.specifier.contains(found.version, prereleases=True):
                missing.append(req)
                continue
            plan.wheels[name] = found
            if (name, tuple(sorted(req.extras))) not in seen:
                seen.add((name, tuple(sorted(req.extras))))
                queue.append((found, tuple(sorted(req.extras))))
    for name in set(plan.left_out) & set(plan.wheels):  # another requirement needs another version
        plan.replaced[name] = f"{plan.left_out.pop(name)} -> {plan.wheels[name].version}"
    for name in set(have) & set(plan.wheels) - set(plan.replaced):
        plan.replaced[name] = f"{have[name]} -> {plan.wheels[name].version}"
    return plan, missing


def _stub_environment(folder: Path, have: dict[NormalizedName, Version], metadata: dict[NormalizedName, dict]) -> Path:
    """A venv whose only installed distributions are stubs of the target's packages: their
    name, version and, where the index has them, their requirements, so that pip keeps what
    the target's own packages pin (torch pins its CUDA libraries) and says so when it cannot."""
    venv.EnvBuilder(with_pip=False).create(folder)
    site = next(folder.glob("lib/python*/site-packages"))
    for name, version in have.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        meta = metadata.get(name, {})
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra", [])]
        lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist", [])]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
    return folder / "bin" / "python"


def check_pip() -> None:
    found = Version(md.version("pip"))
    if found < MIN_PIP:
        raise BuildError(
            f"pip {found} in {sys.prefix} cannot plan for another platform with --dry-run",
            f"python -m pip install 'pip>={MIN_PIP}' (the nox session does)",
        )


def _pip_report(python: Path, args: list[str], scratch: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """pip's install plan (--dry-run --report) for the environment of `python`."""
    report = scratch / "report.json"
    report.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--dry-run",
        "--quiet",
        "--report",
        str(report),
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return done, json.loads(report.read_text())["install"] if done.returncode == 0 else []


_NOT_FOUND = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")


def _host_metadata(
    have: dict[NormalizedName, Version], empty: Path, target: Target, pip_args: list[str], scratch: Path, log
) -> dict[NormalizedName, dict]:
    """The index's metadata of each of the target's packages (by public version: a local
    label such as +cu130 is not on the index); those the index lacks get none."""
    pins = {name: f"{name}=={version.public}" for name, version in have.items()}
    while pins:
        done, report = _pip_report(empty, ["--no-deps", *target.pip_options(), *pip_args, *pins.values()], scratch)
        if done.returncode == 0:
            return {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in report}
        lacking = [canonicalize_name(n) for n in _NOT_FOUND.findall(done.stderr)]
        if not lacking or not set(lacking) & set(pins):
            raise BuildError(
                f"pip could not look up the target's packages:\n{done.stderr.strip()[-3000:]}",
                "check the --have file and the index options",
            )
        log(f"no metadata on the index for {', '.join(lacking)}: their own requirements stay unknown")
        for name in lacking:
            pins.pop(name, None)
    return {}


def _pip_plan(
    requirements: list[str], stub_python: Path, target: Target, pip_args: list[str], scratch: Path
) -> dict[NormalizedName, Wheel]:
    done, report = _pip_report(stub_python, [*target.pip_options(), *pip_args, *requirements], scratch)
    if done.returncode != 0:
        raise BuildError(
            f"pip could not resolve the bundle for Python {target.python_version} on "
            f"{target.platforms[0]} next to the target's packages:\n{done.stderr.strip()[-3000:]}",
            "check the requirement pip names; --platform/--python-version must match the target, "
            "and the --have file must hold together (`pip check` on the target)",
        )
    plan = {}
    for item in report:
        meta = item["metadata"]
        requires = tuple(Requirement(r) for r in meta.get("requires_dist", []))
        plan[canonicalize_name(meta["name"])] = Wheel(
            canonicalize_name(meta["name"]), Version(meta["version"]), requires
        )
    return plan


def _without_marker(req: Requirement) -> str:
    copy = Requirement(str(req))
    copy.marker = None
    return str(copy)


def resolve(
    root_wheel: Path, have: dict[NormalizedName, Version], target: Target, pip_args: list[str] = (), log=print
) -> Plan:
    """The wheels (name, version) the target needs besides its own packages, root included."""
    check_pip()
    root = Wheel.read(root_wheel)
    environment = target.marker_environment()
    # The target's packages by name: their own requirements then take part (torch keeps the
    # CUDA libraries it pins), yet pip may still replace one that the root needs in another version.
    requirements = [str(root_wheel), *sorted(have)]
    with tempfile.TemporaryDirectory(prefix="kvwarm-bundle-plan-") as tmp:
        metadata = {}
        if have:
            empty = _stub_environment(Path(tmp) / "empty", {}, {})
            metadata = _host_metadata(have, empty, target, list(pip_args), Path(tmp), log)
        stub = _stub_environment(Path(tmp) / "target", have, metadata)
        for _ in range(ROUNDS):
            log(
                f"pip plans {len(requirements) - len(have)} requirement(s) for Python {target.python_version}, "
                f"{len(have)} package(s) on the target"
            )
            candidates = _pip_plan(requirements, stub, target, list(pip_args), Path(tmp))
            plan, missing = walk(root, candidates, have, environment)
            if not missing:
                return plan
            log(f"the target's markers also need: {', '.join(map(str, missing))}")
            requirements += [_without_marker(r) for r in missing]
    raise BuildError(
        f"after {ROUNDS} rounds pip's plan still lacks {', '.join(map(str, missing))} for the target",
        "add them to the target's freeze file (--have) if the host has them",
    )
