"""OCI image builders: which one is here (docker buildx, podman, buildah), how to run its
subcommands, and what it says about a local image."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError

# What the official image keeps and ours must not change.
KEPT = ("Entrypoint", "Cmd", "User", "WorkingDir")
TAIL_LINES = 25


def run_command(argv: list[str], log=print, capture: bool = False, name: str | None = None) -> str:
    """Run argv; a failure names the command (`name`, else the program), the whole argv and the
    last lines it printed (a CI log that is cut in the middle still shows why)."""
    log("  $ " + shlex.join(argv))
    if capture:
        result = subprocess.run(argv, text=True, capture_output=True, check=False)
        returncode, output, tail = result.returncode, result.stdout, (result.stderr or "").strip()[-2000:]
    else:
        # Streamed as it comes (image builds take minutes), the tail kept for the error.
        last = deque(maxlen=TAIL_LINES)
        with subprocess.Popen(
            argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace"
        ) as process:
            for line in process.stdout:
                print(line, end="", flush=True)
                last.append(line.rstrip())
        returncode, output, tail = process.returncode, "", "\n".join(last)
    if returncode != 0:
        raise BuildError(
            f"`{name or Path(argv[0]).name}` failed (exit {returncode}); its last lines:\n{tail}\n"
            f"  command: {shlex.join(argv)}",
            "fix what the command says and run again",
        )
    return output


@dataclass(frozen=True)
class Builder:
    name: str  # docker | podman | buildah
    command: tuple[str, ...]  # the tool with its global options
    build_options: tuple[str, ...] = ()

    def build_argv(self, dockerfile: Path, tag: str, args: dict[str, str], context: Path) -> list[str]:
        verb = {"docker": ("buildx", "build", "--load"), "podman": ("build",), "buildah": ("bud",)}[self.name]
        argv = [*self.command, *verb, *self.build_options, "-f", str(dockerfile), "-t", tag]
        for key, value in args.items():
            argv += ["--build-arg", f"{key}={value}"]
        return argv + [str(context)]

    def run(self, *args: str, log=print, capture: bool = False) -> str:
        """`args` after the tool and its global options; a failure names `<builder> <subcommand>`."""
        return run_command([*self.command, *args], log=log, capture=capture, name=f"{self.name} {args[0]}")

    def remove_image(self, image: str, force: bool = True) -> bool:
        """Best effort (cleanup): an image that is not there is no error. Not `force`d, an
        image a container still uses stays. Whether it was removed."""
        argv = [*self.command, "rmi", *(["-f"] if force else []), image]
        return subprocess.run(argv, capture_output=True, check=False).returncode == 0

    def remove_container(self, container: str) -> None:
        """Best effort (cleanup): a container that is not there is no error."""
        subprocess.run([*self.command, "rm", container], capture_output=True, check=False)


def detect_builder(path: str | None = None) -> Builder:
    """docker buildx, else podman, else buildah (first found on PATH)."""
    docker = shutil.which("docker", path=path)
    if docker and subprocess.run([docker, "buildx", "version"], capture_output=True, check=False).returncode == 0:
        return Builder("docker", (docker,))
    for name in ("podman", "buildah"):
        found = shutil.which(name, path=path)
        if found:
            return Builder(name, (found,))
    raise BuildError(
        "no image builder found: looked for docker buildx (docker with its buildx plugin), podman "
        "and buildah on PATH" + (" (docker is there, but `docker buildx version` fails)" if docker else ""),
        "install one of them, e.g. `apt-get install -y buildah` (as root it builds without a daemon; "
        "set STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot inside a container)",
    )


def inspect_image(builder: Builder, image: str) -> dict | None:
    """The builder's inspect output for a local image, None when it has no such image."""
    argv = {"buildah": [*builder.command, "inspect", "--type", "image", image]}.get(
        builder.name, [*builder.command, "image", "inspect", image]
    )
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return None
    data = json.loads(result.stdout)
    return data[0] if isinstance(data, list) else data


def image_config(builder: Builder, image: str) -> dict:
    """Entrypoint, Cmd, User, WorkingDir, Labels and digest of a local image."""
    data = inspect_image(builder, image)
    if data is None:
        raise BuildError(f"image {image} not found by {builder.name}", "build or pull it first")
    if builder.name == "buildah":
        config, digest = data["OCIv1"].get("config", {}), data.get("FromImageDigest", "")
    else:
        config = data.get("Config", {})
        repo = (data.get("RepoDigests") or [""])[0]
        digest = data.get("Digest") or repo.partition("@")[2]
    out = {key: config.get(key) or None for key in KEPT}
    out["Labels"] = config.get("Labels") or {}
    out["Digest"] = digest
    return out
