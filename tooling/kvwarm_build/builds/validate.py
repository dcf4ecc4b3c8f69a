"""Post-build validation: check what the wheel does, not that the build exited 0."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from wheel.wheelfile import WheelError, WheelFile

from ..errors import BuildError
from ..venvs.deps import layer_on_deps, venv_python
from ..venvs.installer import install
from .repack import WheelName, parse_record

_MARK = "KVWARM-PROBE "
_PROBE = f"""
import importlib, importlib.metadata as md, json, sys
import vllm, vllm.kvwarm
failed = {{}}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = f"{{type(err).__name__}}: {{err}}"
print({_MARK!r} + json.dumps({{
    "dist_version": md.version(sys.argv[1]),
    "vllm_version": vllm.__version__,
    "record": vllm.kvwarm.build_record(),
    "failed_imports": failed,
}}))
"""


def overlay_imports(wheel: Path) -> list[str]:
    """Every vLLM module the overlay (vllm/kvwarm/ in the wheel) imports, itself excluded."""
    found = set()
    with WheelFile(wheel) as zf:
        sources = [zf.read(n) for n in zf.namelist() if n.startswith("vllm/kvwarm/") and n.endswith(".py")]
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    return sorted(m for m in found if m.startswith("vllm.") and not m.startswith("vllm.kvwarm"))


def record_rows(wheel: Path) -> dict[str, str]:
    """RECORD of a wheel as {path: hash}."""
    with WheelFile(wheel) as zf:
        rows = parse_record(zf.read(zf.record_path))
    return {path: hash_ for path, (hash_, _) in rows.items()}


def record_problems(wheel: Path) -> list[str]:
    """Every entry hashes to its RECORD row, and RECORD lists exactly the entries."""
    problems = []
    with WheelFile(wheel) as zf:
        names = {i.filename for i in zf.infolist() if not i.is_dir()}
        for name in sorted(names):
            try:
                zf.read(name)  # WheelFile checks the hash against RECORD while reading
            except WheelError as err:
                problems.append(f"{wheel.name}: {err}")
    rows = set(record_rows(wheel))
    for name in sorted(rows - names):
        problems.append(f"{wheel.name}: RECORD lists {name}, which is not in the wheel")
    return problems


def compiled_problems(built: Path, upstream: Path) -> list[str]:
    """Every compiled extension is byte-identical to the release's (same RECORD hash)."""
    ours, theirs = record_rows(built), record_rows(upstream)
    problems = []
    for name in sorted({n for n in theirs if n.endswith(".so")} | {n for n in ours if n.endswith(".so")}):
        if ours.get(name) != theirs.get(name):
            problems.append(f"{built.name}: {name} differs from {upstream.name} (or is missing from one)")
    return problems


def import_problems(built: Path, dist: str, record: dict, deps_site: Path, modules=None) -> list[str]:
    """Install --no-deps into a throwaway venv; `import vllm` must report label and record,
    and every vLLM module the overlay uses (or `modules`) must import."""
    with tempfile.TemporaryDirectory(prefix="kvwarm-validate-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = venv_python(venv)
        layer_on_deps(python, deps_site)  # brings torch and vLLM's requirements
        try:
            # Imported once: byte-compiling every file would cost more than it saves.
            install(python, "--no-deps", str(built), compile_bytecode=False, local=True, log=lambda *_: None)
        except BuildError as err:
            return [f"installing {built.name} --no-deps failed: {err.problem}"]
        probe = subprocess.run(
            [str(python), "-c", _PROBE, dist, *(overlay_imports(built) if modules is None else modules)],
            capture_output=True,
            text=True,
            check=False,
        )
    lines = [l for l in probe.stdout.splitlines() if l.startswith(_MARK)]
    if probe.returncode != 0 or not lines:
        return [f"import vllm from {built.name} failed:\n{probe.stderr.strip()[-3000:]}"]
    seen = json.loads(lines[-1][len(_MARK) :])
    problems = [
        f"import {name} failed (the overlay uses it): {why}" for name, why in sorted(seen["failed_imports"].items())
    ]
    version = WheelName.parse(built.name).version
    for key in ("dist_version", "vllm_version"):
        if seen[key] != version:
            problems.append(f"{key} is {seen[key]!r}, expected {version!r}")
    if record.get("version") != version:
        problems.append(f"build record version {record.get('version')!r} is not the wheel's {version!r}")
    if seen["record"] != record:
        problems.append(f"vllm.kvwarm.build_record() is {seen['record']}, expected {record}")
    return problems


def validate(built: Path, upstream: Path, dist: str, record: dict, deps_site: Path | None) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The install-and-import check runs in subprocesses: let it use the other core
        # while this one re-reads the wheel.
        imported = pool.submit(import_problems, built, dist, record, deps_site) if deps_site else None
        problems = record_problems(built) + compiled_problems(built, upstream)
        if imported is not None:
            problems += imported.result()
    if problems:
        raise BuildError(
            "validation of the built wheel failed:\n  " + "\n  ".join(problems),
            "nothing was put in dist/; fix the cause above and build again",
        )
