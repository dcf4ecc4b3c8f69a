"""Image references and labels: qualified names, the pinned base, the default tag, the
build arguments of images/Dockerfile and the labels they must produce."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from .. import project
from ..builds.repack import WheelName
from ..errors import BuildError
from ..git import git
from ..releases import Release
from .builders import KEPT, Builder, image_config, inspect_image

SERIES_LABEL = "io.kvwarm.series-digest"


def untagged(ref: str) -> str:
    """name:tag -> name (a registry port's colon comes before the last slash)."""
    name, _, tag = ref.rpartition(":")
    return name if name and "/" not in tag else ref


def qualified(ref: str) -> str:
    """Docker Hub short names in full (vllm/vllm-openai -> docker.io/vllm/vllm-openai):
    podman and buildah refuse short names unless registries.conf says where to look."""
    first, slash, _ = ref.partition("/")
    if not slash:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def resolve_base(builder: Builder, ref: str, log=print) -> tuple[str, str]:
    """(the reference to build FROM, its digest): a ref pinned by digest is kept; otherwise
    the image is pulled when missing and pinned to the digest the builder holds, so the
    label names exactly the base the build used."""
    if "@" in ref:
        return ref, ref.rpartition("@")[2]
    if inspect_image(builder, ref) is None:
        log(f"  $ {builder.name} pull {ref}")
        if subprocess.run([*builder.command, "pull", ref], check=False).returncode != 0:
            raise BuildError(
                f"{builder.name} could not pull the base image {ref} (output above)",
                "check access to its registry (or log in); pass --base with a reachable copy, "
                "or where no registry is reachable run the stand-in build (nox -s image-standin-X.Y)",
            )
    digest = image_config(builder, ref)["Digest"]
    if not digest:
        raise BuildError(f"base image {ref} has no digest", "pin it in releases.toml as name@sha256:...")
    return f"{untagged(ref)}@{digest}", digest


def created_time() -> str:
    """RFC 3339 UTC: SOURCE_DATE_EPOCH when set (reproducible labels), else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), UTC) if epoch else datetime.now(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def source_url() -> str:
    env = os.environ.get("KVWARM_SOURCE_URL")
    if env:
        return env
    out = git(project.ROOT, "remote", "get-url", "origin", check=False, user_config=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def build_args(release: Release, wheel: Path, record: dict, base: str, base_digest: str) -> dict[str, str]:
    """Every ARG of images/Dockerfile, from releases.toml, the built wheel and git."""
    name = WheelName.parse(wheel.name)
    if name.version != release.patched_version or record.get("version") != name.version:
        raise BuildError(
            f"{wheel.name} is not {release.patched_version} (its record says {record.get('version')})",
            f"rebuild it: nox -s build-{release.short}",
        )
    return {
        "VLLM_VERSION": release.version,
        "KVWARM_BUILD": str(release.build),
        "VLLM_DIST": name.dist,
        "WHEEL": wheel.name,
        "BASE_IMAGE": base,
        "BASE_DIGEST": base_digest,
        "KVWARM_SERIES_DIGEST": record["series_digest"],
        "REVISION": project.revision(),
        "CREATED": created_time(),
        "SOURCE": source_url(),
    }


def expected_labels(args: dict[str, str]) -> dict[str, str]:
    return {
        "org.opencontainers.image.base.name": args["BASE_IMAGE"],
        "org.opencontainers.image.base.digest": args["BASE_DIGEST"],
        "org.opencontainers.image.version": f"{args['VLLM_VERSION']}+kvwarm.{args['KVWARM_BUILD']}",
        "org.opencontainers.image.revision": args["REVISION"],
        "org.opencontainers.image.created": args["CREATED"],
        "org.opencontainers.image.source": args["SOURCE"],
        SERIES_LABEL: args["KVWARM_SERIES_DIGEST"],
    }


def default_tag(base: str, release: Release) -> str:
    """vllm/vllm-openai:vX.Y.Z -> vllm/vllm-openai-kvwarm:vX.Y.Z-kvwarm.N (a tag has no '+')."""
    repo = untagged(base.partition("@")[0])
    return f"{repo}-kvwarm:v{release.version}-{release.label}"


def config_problems(built: dict, base: dict, labels: dict[str, str]) -> list[str]:
    problems = [
        f"{key} is {built[key]!r}, the base image's is {base[key]!r}" for key in KEPT if built[key] != base[key]
    ]
    for key, value in labels.items():
        if built["Labels"].get(key) != value:
            problems.append(f"label {key} is {built['Labels'].get(key)!r}, expected {value!r}")
    return problems
