"""The kit: the patched wheel and what a kit file carries (kit_spec), packed for a host that
takes a few files per transfer and has no package index.

The wheels go into one uncompressed tar (they are compressed already), cut into parts of
at most the kit file's part_mib. The kit folder holds p1 ... pN, each with its part, the
manifest (sha256 of every part, of the joined tar and of every wheel, what the host keeps,
what is left out and the settings that make that safe) and the installer (kit_install.py
as install.py, with the bundle installer beside it as bundle_install.py), so any one folder says what the whole kit
is and `python3 pK/install.py` installs it once every part is there. Written in a staging
folder next to `out` and moved into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from packaging.utils import canonicalize_name

from ..errors import BuildError
from ..fetch import sha256_of
from .kit_spec import KitSpec, plan_kit
from .make import _download, _place, _wheel_files, manifest_head
from .resolve import Plan, Target, Wheel, read_have, resolve

MANIFEST = "manifest.json"
INSTALLER = "install.py"
ARCHIVE = "kit.tar"
MIB = 1 << 20
HERE = Path(__file__).resolve().parent
# What each part's folder holds besides its part: the installer and the helpers it imports.
INSTALL_FILES = {INSTALLER: HERE / "kit_install.py", "bundle_install.py": HERE / "install.py"}


def part_folder(number: int) -> str:
    return f"p{number}"


def _pack(files: list[Path], archive: Path) -> None:
    """One uncompressed tar of `files` (flat, in the order given), the same bytes every time."""
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tar.gettarinfo(str(path), arcname=path.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)


def _cut(archive: Path, folder: Path, part_bytes: int) -> list[dict]:
    parts = []
    with open(archive, "rb") as f:
        while chunk := f.read(part_bytes):
            number = len(parts) + 1
            name = f"{ARCHIVE}.{number:03d}"
            (folder / part_folder(number)).mkdir()
            (folder / part_folder(number) / name).write_bytes(chunk)
            parts.append(
                {
                    "folder": part_folder(number),
                    "file": name,
                    "size": len(chunk),
                    "sha256": hashlib.sha256(chunk).hexdigest(),
                }
            )
    return parts


def _too_many(parts: int, spec: KitSpec, entries: list[dict], total: int) -> BuildError:
    largest = sorted(entries, key=lambda e: -e["size"])[:5]
    named = ", ".join(f"{e['name']} {e['size'] / MIB:.1f} MiB" for e in largest)
    return BuildError(
        f"the kit is {total / MIB:.1f} MiB, {parts} parts of {spec.part_mib} MiB; {spec.path.name} allows "
        f"{spec.max_parts} (largest wheels: {named})",
        "carry less ([leave] with a reason), or raise max_parts in the kit file if the host takes more transfers",
    )


def _check_torch(root: Wheel, have: dict, spec: KitSpec) -> None:
    """A kit never carries torch: the release must pin the torch the host has."""
    pin = next((r for r in root.requires if canonicalize_name(r.name) == "torch" and not r.marker), None)
    host = have.get(canonicalize_name("torch"))
    if pin is not None and host is not None and not pin.specifier.contains(host, prereleases=True):
        raise BuildError(
            f"vLLM {root.version} pins {pin}; the host of {spec.path.name} has torch {host}",
            "make the kit of the release whose cuda torch is the host's (releases.toml, flavours.cuda.torch)",
        )


def make_kit(wheel: Path, record: dict, spec: KitSpec, out: Path, pip_args: list[str] = (), log=print) -> dict:
    """Write the kit for the patched `wheel` (its build `record`) into `out`; returns the manifest."""
    started = time.monotonic()
    target = Target(spec.python_version, spec.platforms)
    have = read_have(spec.have)
    root = Wheel.read(wheel)
    _check_torch(root, have, spec)
    candidates = resolve(wheel, have, target, list(pip_args), log=log).wheels
    plan = plan_kit(spec, root, candidates, have, target.marker_environment())
    for name, change in sorted(plan.replaced.items()):
        log(f"warning: the kit replaces the host's {name} ({change}): a requirement needs another version")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        wheels = staging / "wheels"
        wheels.mkdir()
        _place(wheel, wheels / wheel.name)
        _download(Plan(wheels=plan.wheels), root, wheels, target, list(pip_args), log)
        files = _wheel_files(wheels, Plan(wheels=plan.wheels))
        ordered = sorted(files, key=lambda p: (files[p].name != root.name, files[p].name))
        entries = [
            {
                "file": p.name,
                "name": files[p].name,
                "version": str(files[p].version),
                "size": p.stat().st_size,
                "sha256": sha256_of(p),
                "why": "the patched build" if files[p].name == root.name else plan.why[files[p].name],
            }
            for p in ordered
        ]
        archive = staging / ARCHIVE
        _pack(ordered, archive)
        size, digest = archive.stat().st_size, sha256_of(archive)
        parts = _cut(archive, staging, spec.part_mib * MIB)
        if len(parts) > spec.max_parts:
            raise _too_many(len(parts), spec, entries, size)
        manifest = {
            "schema": 1,
            "kind": "kvwarm-kit",
            "kit_file": spec.path.name,
            **manifest_head(wheel, root, record, target, spec.have.name),
            "settings": spec.settings(),
            "archive": {"file": ARCHIVE, "size": size, "sha256": digest},
            "parts": parts,
            "wheels": entries,
            "left_to_host": dict(sorted(plan.left_to_host.items())),
            "left_out": dict(sorted(plan.left_out.items())),
            "replaced": dict(sorted(plan.replaced.items())),
        }
        shutil.rmtree(wheels)
        archive.unlink()
        for part in parts:
            folder = staging / part["folder"]
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            for name, source in INSTALL_FILES.items():
                shutil.copyfile(source, folder / name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"kit {out}: {len(entries)} wheel(s), {size / MIB:.1f} MiB in {len(parts)} part(s) of at most "
        f"{spec.part_mib} MiB; {len(plan.left_to_host)} requirement(s) left to the host, {len(plan.left_out)} "
        f"left out; in {time.monotonic() - started:.0f} s"
    )
    for entry in entries:
        log(f"  {entry['size'] / MIB:7.2f} MiB  {entry['name']} {entry['version']}: {entry['why']}")
    return manifest


def carry_paths(kit: Path, manifest: dict) -> list[str]:
    """The folders, relative to the repository root, that the device calls carry one by one."""
    return [(kit / p["folder"]).as_posix() for p in manifest["parts"]]
