"""Install an offline kvwarm bundle (this file is copied into every bundle as install.py).

Run it with the target host's python, from anywhere:

    python install.py --venv DIR     make DIR a venv on top of this python's packages (or reuse
                                     it) and install there
    python install.py --target DIR   put the bundle's wheels into DIR (pip --target, no
                                     dependency check: DIR goes on PYTHONPATH)
    python install.py                install into this python's own environment
    python install.py --verify-only  check every file and part, install nothing

Every file and every part is checked against manifest.json before anything is installed; a
missing or corrupt one stops the install and is named. Split files are joined in a scratch
folder (--work) and checked again. pip then installs from this folder only (--no-index,
--isolated: no index, config file or PIP_* variable is consulted), and
`python -m vllm.kvwarm selfcheck` checks the result against the manifest.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

BUNDLE = Path(__file__).resolve().parent
WHEELS = "wheels"
CHUNK = 1 << 20


def sha256(path: Path) -> str:  # kvwarm_build.fetch has one too; this file runs without it
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(path: Path, size: int, expected: str, what: str) -> str | None:
    """None when the file is there with the manifest's size and sha256, else what is wrong."""
    again = f"copy it into {path.parent} again from the source bundle"
    if not path.is_file():
        return f"{what} {path.name} is missing ({size} bytes): {again}"
    found = path.stat().st_size
    if found != size:
        return f"{what} {path.name} has {found} bytes, the manifest says {size}: {again}"
    got = sha256(path)
    if got != expected:
        return f"{what} {path.name} is corrupt (sha256 {got}, the manifest says {expected}): {again}"
    return None


def verify(bundle: Path, manifest: dict) -> list[str]:
    problems = []
    for entry in manifest["files"]:
        parts = entry.get("parts")
        if not parts:
            problems.append(check_file(bundle / WHEELS / entry["file"], entry["size"], entry["sha256"], "file"))
            continue
        for number, part in enumerate(parts, 1):
            what = f"part {number} of {len(parts)} of {entry['file']}:"
            problems.append(check_file(bundle / WHEELS / part["file"], part["size"], part["sha256"], what))
    return [p for p in problems if p]


def stage(bundle: Path, manifest: dict, work: Path) -> list[Path]:
    """Every wheel in `work`: whole files linked, split ones joined and checked again."""
    staged = []
    for entry in manifest["files"]:
        dest = work / entry["file"]
        if not entry.get("parts"):
            os.symlink(bundle / WHEELS / entry["file"], dest)
        else:
            with open(dest, "wb") as out:
                for part in entry["parts"]:
                    with open(bundle / WHEELS / part["file"], "rb") as f:
                        shutil.copyfileobj(f, out, CHUNK)
            if sha256(dest) != entry["sha256"]:
                raise SystemExit(
                    f"install.py: the parts of {entry['file']} join to the wrong sha256 "
                    f"(the manifest's parts list is inconsistent): make the bundle again"
                )
        staged.append(dest)
    return staged


def target_python(args) -> str:
    if not args.venv:
        return sys.executable
    python = args.venv / "bin" / "python"
    if not python.exists():
        # On top of this python's packages: the bundle leaves out what the host already has.
        print(f"install.py: creating the venv {args.venv}", flush=True)
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(args.venv)
    return str(python)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--venv", type=Path, help="install into this venv (made if missing)")
    where.add_argument("--target", type=Path, help="install the wheels into this folder (pip --target)")
    where.add_argument("--verify-only", action="store_true", help="check every file and part, install nothing")
    parser.add_argument(
        "--no-deps", action="store_true", help="install exactly the bundle's wheels without pip's dependency check"
    )
    parser.add_argument("--no-selfcheck", action="store_true", help="skip `python -m vllm.kvwarm selfcheck`")
    parser.add_argument("--work", type=Path, help="scratch folder for joined files (default: the system's)")
    args = parser.parse_args(argv)

    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    root = manifest["root"]
    problems = verify(BUNDLE, manifest)
    for problem in problems:
        print(f"install.py: {problem}", file=sys.stderr)
    if problems:
        print(f"install.py: {len(problems)} problem(s); nothing was installed", file=sys.stderr)
        return 1
    count = sum(len(e.get("parts") or [e]) for e in manifest["files"])
    print(f"install.py: {len(manifest['files'])} wheel(s) in {count} file(s) match manifest.json", flush=True)
    if args.verify_only:
        return 0

    python = target_python(args)
    with tempfile.TemporaryDirectory(prefix="kvwarm-bundle-", dir=args.work) as tmp:
        work = Path(tmp)
        wheels = stage(BUNDLE, manifest, work)
        pip = [python, "-m", "pip", "--isolated", "install", "--no-index", "--find-links", str(work)]
        if args.target:
            # --upgrade: without it pip keeps what an earlier run left in DIR.
            pip += ["--target", str(args.target), "--upgrade", "--no-deps", *map(str, wheels)]
        elif args.no_deps:
            pip += ["--no-deps", *map(str, wheels)]
        else:
            pip += [f"{root['dist']}=={root['version']}"]
        if subprocess.run(pip, check=False).returncode != 0:
            print(
                "install.py: pip failed. Without --no-deps, pip also checks that this host has every package "
                'the bundle left out (manifest.json "left_out"); make the bundle again with '
                "`--have` set to `pip freeze` of this host.",
                file=sys.stderr,
            )
            return 1
        if args.no_selfcheck:
            return 0
        env = dict(os.environ)
        if args.target:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.target.resolve()), env.get("PYTHONPATH")]))
        check = [
            python,
            "-m",
            "vllm.kvwarm",
            "selfcheck",
            "--dist",
            root["dist"],
            "--expect-version",
            root["version"],
            "--expect-series-digest",
            root["series_digest"],
        ]
        return subprocess.run(check, env=env, cwd=work, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
