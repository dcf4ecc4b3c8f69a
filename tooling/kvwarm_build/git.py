"""The one way the tooling runs git.

By default git runs as nobody in particular: no system or global config (format.*, diff.*
and apply.* settings would change what the export writes and what `git apply` accepts), a
fixed identity and date for the commits the tooling makes (materialise), and C messages.
Questions about the user's own checkout (its revision, its remote) keep the user's config,
where settings such as safe.directory live.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .errors import BuildError

IDENTITY = {
    "GIT_AUTHOR_NAME": "kvwarm",
    "GIT_AUTHOR_EMAIL": "kvwarm@localhost",
    "GIT_COMMITTER_NAME": "kvwarm",
    "GIT_COMMITTER_EMAIL": "kvwarm@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


def git(
    cwd: Path, *args: str, check: bool = True, user_config: bool = False, outside_repo: bool = False
) -> subprocess.CompletedProcess:
    """`git -C cwd ARGS`, its output captured as text.

    check: a non-zero exit raises BuildError with git's message (else the caller reads
    returncode). user_config: keep the user's and the system's git config. outside_repo:
    `cwd` is a plain folder (a scratch tree for `git apply`); git must not find an enclosing
    repository and resolve paths against it, so the search stops at cwd's parent.
    """
    env = dict(os.environ, LC_ALL="C", **IDENTITY)
    if not user_config:
        env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
    if outside_repo:
        env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
    result = subprocess.run(["git", "-C", str(cwd), *args], env=env, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} in {cwd} failed: {result.stderr.strip()}", "see the git message")
    return result
