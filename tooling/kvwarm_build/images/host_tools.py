"""Host programs a build needs, installed with apt-get when missing and we are root."""

from __future__ import annotations

import os
import shutil
import subprocess

from ..errors import BuildError


def ensure_host_tools(tools: tuple[str, ...], why: str, log=print) -> None:
    """Every program in `tools` on PATH, else apt-get install them (root only), else an
    error naming the missing ones. `why` says what needs them."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildError(
            f"{why} needs {' and '.join(missing)}",
            f"install them (Debian/Ubuntu: apt-get install -y {' '.join(missing)})",
        )
    log(f"installing {' '.join(missing)} with apt-get ({why} needs them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *missing]):
        log("  $ " + " ".join(argv))
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
