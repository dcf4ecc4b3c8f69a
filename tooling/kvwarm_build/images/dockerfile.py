"""Drop-in images: images/Dockerfile on a release's official base, with the patched wheel.

The build runs with whichever OCI builder is here (builders.py); the base is pinned
by digest and the labels come from refs.py. Where the official base cannot be pulled
(CI), standin.py builds the very same Dockerfile on a local stand-in.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from .. import project
from ..errors import BuildError
from ..releases import Release
from .builders import Builder, image_config, run_command
from .refs import build_args, config_problems, default_tag, expected_labels, qualified, resolve_base

DOCKERFILE = project.ROOT / "images" / "Dockerfile"
# Metadata-only `vllm` for the cpu flavour, run by the Dockerfile (see the script).
DIST_ALIAS = project.ROOT / "images" / "vllm_dist_alias.py"


def build_image(
    builder: Builder, release: Release, wheel: Path, record: dict, base_ref: str, tag: str | None = None, log=print
) -> tuple[str, dict[str, str]]:
    """Build images/Dockerfile with `wheel`; check the image keeps the base's entrypoint,
    command, user and workdir and carries the labels, else remove it. Returns (tag, build args)."""
    base, digest = resolve_base(builder, qualified(base_ref), log=log)
    args = build_args(release, wheel, record, base, digest)
    tag = tag or default_tag(base_ref, release)
    with tempfile.TemporaryDirectory(prefix="kvwarm-image-") as context:
        # The context is the wheel and the alias script: nothing else of the project is sent.
        if wheel.stat().st_dev == os.stat(context).st_dev:
            os.link(wheel, Path(context) / wheel.name)
        else:
            shutil.copy(wheel, context)
        shutil.copy(DIST_ALIAS, context)
        started = time.monotonic()
        run_command(builder.build_argv(DOCKERFILE, tag, args, Path(context)), log=log, name=f"{builder.name} build")
    log(f"built {tag} in {time.monotonic() - started:.0f} s")
    problems = config_problems(image_config(builder, tag), image_config(builder, base), expected_labels(args))
    if problems:
        # Nothing half-done: an image that fails its check is not left under its tag (nor
        # in the stand-in's vfs store, where each one costs gigabytes).
        builder.remove_image(tag)
        raise BuildError(f"image {tag} (removed): " + "; ".join(problems), "fix images/Dockerfile")
    log(f"{tag}: labels as expected; entrypoint, cmd, user and workdir kept from {base}")
    return tag, args
