"""An offline bundle of a patched wheel for a host without a package index.

The folder holds the patched wheel and the dependency wheels the target lacks (wheels/),
manifest.json (every file with its name, version, size and sha256; a file cut with
`split_mib` lists its parts instead of itself) and install.py (bundles/install.py: verify,
join, pip install --no-index, selfcheck). It is written in a staging folder next to `out`
and moved into place when complete, so a failed run leaves the previous bundle intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from ..builds.build import read_built_record
from ..errors import BuildError
from ..fetch import sha256_of
from .resolve import Plan, Target, Wheel, read_have, resolve

MANIFEST = "manifest.json"
INSTALLER = "install.py"
WHEELS = "wheels"
MIB = 1 << 20


def _download(plan: Plan, root: Wheel, dest: Path, target: Target, pip_args: list[str], log) -> None:
    pins = [f"{w.name}=={w.version}" for w in plan.wheels.values() if w.name != root.name]
    if not pins:
        return
    log(f"downloading {len(pins)} dependency wheel(s) for Python {target.python_version}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--dest",
        str(dest),
        *target.pip_options(),
        *pip_args,
        *pins,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(
            f"pip could not download the planned wheels:\n{done.stderr.strip()[-3000:]}",
            "check the index options (--index-url/--find-links) and the network",
        )


def _wheel_files(folder: Path, plan: Plan) -> dict[Path, Wheel]:
    """Each planned wheel's file in `folder`, exactly one per planned (name, version)."""
    files = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        wheel = plan.wheels.get(canonicalize_name(name))
        if wheel is None or wheel.version != version:
            raise BuildError(f"pip downloaded {path.name}, which the plan does not hold", "report this as a bug")
        files[path] = wheel
    missing = set(plan.wheels) - {w.name for w in files.values()}
    if missing or len(files) != len(plan.wheels):
        raise BuildError(
            f"the bundle lacks wheels for {sorted(missing)} or holds two of one",
            "check the index options; pip downloads one wheel per pin",
        )
    return files


def _split(path: Path, part_bytes: int) -> list[dict]:
    """Cut `path` into numbered parts of at most part_bytes next to it; the whole file goes."""
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            part = path.with_name(f"{path.name}.part{len(parts) + 1:03d}")
            part.write_bytes(chunk)
            parts.append({"file": part.name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    path.unlink()
    return parts


def _entry(path: Path, wheel: Wheel, split_mib: int | None) -> dict:
    entry = {
        "file": path.name,
        "name": wheel.name,
        "version": str(wheel.version),
        "size": path.stat().st_size,
        "sha256": sha256_of(path),
    }
    if split_mib and entry["size"] > split_mib * MIB:
        entry["parts"] = _split(path, split_mib * MIB)
    return entry


def _place(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another filesystem
        shutil.copyfile(source, dest)


def manifest_head(wheel: Path, root: Wheel, record: dict, target: Target, have: str | None) -> dict:
    """A manifest's `root` and `target`: what was packed, for which host (bundles and kits)."""
    return {
        "root": {
            "file": wheel.name,
            "dist": str(root.name),
            "version": str(root.version),
            "series_digest": record["series_digest"],
            "release": record["release"],
            "flavour": record["flavour"],
        },
        "target": {
            "python_version": target.python_version,
            "platforms": list(target.platforms),
            "implementation": target.implementation,
            "have": have,
        },
    }


def index_options(index_url: str | None, find_links: list[str], no_index: bool) -> list[str]:
    """pip's options for where the bundle's wheels come from: an index (default: pip's own
    configuration), folders of wheels, or those folders alone."""
    if no_index and not find_links:
        raise BuildError(
            "--no-index without --find-links leaves pip nowhere to find wheels",
            "add --find-links FOLDER (repeatable), or drop --no-index",
        )
    return (
        (["--index-url", index_url] if index_url else [])
        + [option for link in find_links for option in ("--find-links", link)]
        + (["--no-index"] if no_index else [])
    )


def make_bundle(
    wheel: Path,
    out: Path,
    have_file: Path | None = None,
    target: Target | None = None,
    split_mib: int | None = None,
    pip_args: list[str] = (),
    log=print,
) -> dict:
    """Write the bundle for the patched `wheel` into `out` and return its manifest."""
    started = time.monotonic()
    if split_mib is not None and split_mib < 1:
        raise BuildError(f"--split-mib {split_mib} is not a size", "give the largest part size in MiB, 1 or more")
    target = target or Target()
    record = read_built_record(wheel)
    if record is None:
        raise BuildError(f"{wheel} has no kvwarm build record", "bundle a wheel built by `kvwarm-build build`")
    have = read_have(have_file) if have_file else {}
    root = Wheel.read(wheel)
    plan = resolve(wheel, have, target, list(pip_args), log=log)
    for name, change in sorted(plan.replaced.items()):
        log(f"warning: the bundle replaces the target's {name} ({change}): a requirement needs another version")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (staging / WHEELS).mkdir()
        _place(wheel, staging / WHEELS / wheel.name)
        _download(plan, root, staging / WHEELS, target, list(pip_args), log)
        files = [_entry(path, w, split_mib) for path, w in _wheel_files(staging / WHEELS, plan).items()]
        manifest = {
            "schema": 1,
            **manifest_head(wheel, root, record, target, have_file.name if have_file else None),
            "split_mib": split_mib,
            "left_out": dict(sorted(plan.left_out.items())),
            "replaced": dict(sorted(plan.replaced.items())),
            "files": sorted(files, key=lambda e: e["file"]),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.copyfile(Path(__file__).with_name("install.py"), staging / INSTALLER)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    total = sum(e["size"] for e in manifest["files"])
    log(
        f"bundle {out}: {len(files)} wheel(s), {total / MIB:.1f} MiB, "
        f"{len(plan.left_out)} dependency(ies) left to the target, in {time.monotonic() - started:.1f} s"
    )
    return manifest
