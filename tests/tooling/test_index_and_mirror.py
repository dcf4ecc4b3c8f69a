"""The package index and the Debian mirror come from the user's configuration (pip's, apt's),
each overridable by its KVWARM_* variable; no host is named here but made-up ones."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Index

from kvwarm_build import project
from kvwarm_build.errors import BuildError
from kvwarm_build.fetch import fetch, package_index, pip_config
from kvwarm_build.images import standin as image_standin
from kvwarm_build.images.apt_sources import deb_sources, debian_mirror
from kvwarm_build.releases import Artifact
from kvwarm_build.venvs.installer import failure_fix, index_options, uv_environment

# --- the package index ----------------------------------------------------------------------


@pytest.fixture
def pip_env(monkeypatch, tmp_path):
    """No index variable set and pip reading one config file of the test's (empty)."""
    for variable in ("KVWARM_INDEX_URL", "PIP_INDEX_URL"):
        monkeypatch.delenv(variable, raising=False)
    config = tmp_path / "pip.conf"
    config.write_text("")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    return config


def test_the_index_is_pips_configured_one_install_section_first(pip_env):
    pip_env.write_text("[global]\nindex-url = http://mirror.example/global/simple\n")
    assert package_index() == "http://mirror.example/global/simple"
    pip_env.write_text(pip_env.read_text() + "[install]\nindex-url = http://mirror.example/install/simple\n")
    assert package_index() == "http://mirror.example/install/simple"


def test_pip_index_url_beats_the_config_and_kvwarm_index_url_beats_both(pip_env, monkeypatch):
    pip_env.write_text("[global]\nindex-url = http://mirror.example/global/simple\n")
    monkeypatch.setenv("PIP_INDEX_URL", "http://pip-env.example/simple")
    assert package_index() == "http://pip-env.example/simple"
    monkeypatch.setenv("KVWARM_INDEX_URL", "http://kvwarm.example/simple")
    assert package_index() == "http://kvwarm.example/simple"


def test_without_any_configuration_the_index_is_pips_default(monkeypatch):
    for variable in ("KVWARM_INDEX_URL", "PIP_INDEX_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # pip then reads no config file
    # What pip says its default is, in its own words.
    help_text = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--help"], capture_output=True, text=True, check=True
    ).stdout
    said = re.search(r"--index-url <url>\s+Base URL.*?\(default\s+(\S+?)\)", help_text, re.DOTALL)
    assert said and package_index() == said.group(1)


def test_fetch_reads_the_configured_index_only_when_it_downloads(pip_env, index, tmp_path):
    _, url = index
    data = b"a release file"
    Index.files = {"vllm-1.0.0.tar.gz": data}
    artifact = Artifact("vllm-1.0.0.tar.gz", hashlib.sha256(data).hexdigest())
    pip_env.write_text(f"[global]\nindex-url = {url}\n")
    path = fetch(artifact, tmp_path / "downloads", log=lambda *_: None)
    assert path.read_bytes() == data
    pip_env.write_text("[global]\nindex-url = http://127.0.0.1:9/unreachable\n")
    assert fetch(artifact, tmp_path / "downloads", log=lambda *_: None) == path  # cached: no index asked


def test_an_unreachable_configured_index_is_named_with_the_variable_to_set(pip_env, tmp_path):
    pip_env.write_text("[global]\nindex-url = http://127.0.0.1:9/simple\n")
    with pytest.raises(BuildError) as err:
        fetch(Artifact("vllm-1.0.0.tar.gz", "0" * 64), tmp_path, log=lambda *_: None)
    assert "http://127.0.0.1:9/simple" in err.value.problem and "KVWARM_INDEX_URL" in err.value.fix


def test_uv_installs_from_pips_indexes_with_pips_precedence_and_rule(pip_env, monkeypatch):
    for variable in ("SSL_CERT_FILE", "PIP_CERT", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels/from-env")
    pip_env.write_text(
        "[global]\nindex-url = http://mirror.example/global/simple\n"
        "extra-index-url = file:///extra/one\n  file:///extra/two\nfind-links = /wheels/from-config\n"
        "constraint = /etc/caps.txt\ncert = /etc/ca.crt\n"
        "[install]\nindex-url = http://mirror.example/install/simple\n"
    )
    args, env = index_options(pip_config())
    assert args == [
        "--index-url", "http://mirror.example/install/simple",
        "--extra-index-url", "file:///extra/one", "--extra-index-url", "file:///extra/two",
        "--find-links", "/wheels/from-env",
        "--constraint", "/etc/caps.txt",
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip
    assert env == {"SSL_CERT_FILE": "/etc/ca.crt"}
    # The same as uv's variables, for nox's uv backend (its lists parted as uv parts them).
    assert uv_environment(pip_config()) == {
        "UV_INDEX_URL": "http://mirror.example/install/simple",
        "UV_EXTRA_INDEX_URL": "file:///extra/one file:///extra/two",
        "UV_FIND_LINKS": "/wheels/from-env",
        "UV_CONSTRAINT": "/etc/caps.txt",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "SSL_CERT_FILE": "/etc/ca.crt",
    }
    monkeypatch.setenv("SSL_CERT_FILE", "/users/own.crt")
    assert index_options(pip_config())[1] == {}  # the user's own choice stays


def test_without_any_configuration_uv_keeps_its_default_index(monkeypatch):
    for variable in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_CERT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    assert index_options(pip_config()) == (["--index-strategy", "unsafe-best-match"], {})


# --- the Debian mirror ----------------------------------------------------------------------


def _machine(tmp_path: Path, files: dict[str, str], os_release: str = "ID=debian\nVERSION_CODENAME=bookworm\n"):
    for name, text in {**files, "etc/os-release": os_release}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


DEB822 = """\
Types: deb
# a comment inside the paragraph
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb deb-src
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_the_mirror_is_the_deb822_source_with_the_standin_suite_not_the_security_one(tmp_path):
    root = _machine(tmp_path, {"etc/apt/sources.list.d/debian.sources": DEB822})
    assert debian_mirror("bookworm", root) == "http://mirror.example/debian"


def test_one_line_sources_with_options_and_comments_and_apts_file_order(tmp_path):
    root = _machine(
        tmp_path,
        {
            "etc/apt/sources.list": (
                "# deb http://commented.example/debian bookworm main\n"
                "deb-src http://source-only.example/debian bookworm main\n"
                "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://first.example/debian bookworm main # why\n"
            ),
            "etc/apt/sources.list.d/a.list": "deb [trusted=yes] http://second.example/debian bookworm main\n",
            "etc/apt/sources.list.d/b.list.disabled": "deb http://disabled.example/debian bookworm main\n",
        },
    )
    assert [s.uri for s in deb_sources(root)] == ["http://first.example/debian", "http://second.example/debian"]
    assert debian_mirror("bookworm", root) == "http://first.example/debian"


def test_disabled_paragraphs_and_uris_debootstrap_cannot_read_are_skipped(tmp_path):
    text = (
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb\nURIs: mirror+file:/etc/apt/mirrors.txt\nSuites: bookworm\n\n"
        "Types: deb\nURIs: https://on.example/debian\nSuites:\n bookworm\n"
    )
    root = _machine(tmp_path, {"etc/apt/sources.list.d/x.sources": text})
    assert debian_mirror("bookworm", root) == "https://on.example/debian"


def test_a_debian_machine_of_another_release_gives_its_own_mirror(tmp_path):
    root = _machine(
        tmp_path,
        {"etc/apt/sources.list": "deb http://mirror.example/debian trixie main\n"},
        os_release='ID=debian\nVERSION_CODENAME="trixie"\n',
    )
    assert debian_mirror("bookworm", root) == "http://mirror.example/debian"


def test_another_distribution_gives_no_mirror_and_the_standin_names_the_variable(tmp_path, monkeypatch):
    root = _machine(
        tmp_path,
        {"etc/apt/sources.list": "deb http://archive.example/ubuntu noble main\n"},
        os_release="ID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=noble\n",
    )
    assert debian_mirror("bookworm", root) is None
    monkeypatch.delenv("KVWARM_DEBIAN_MIRROR", raising=False)
    with pytest.raises(BuildError) as err:
        image_standin.debian_mirror(root)
    assert str(root / "etc" / "apt") in err.value.problem and "bookworm" in err.value.problem
    assert "KVWARM_DEBIAN_MIRROR" in err.value.fix
    monkeypatch.setenv("KVWARM_DEBIAN_MIRROR", "http://override.example/debian")
    assert image_standin.debian_mirror(root) == "http://override.example/debian"


def test_the_debian_mirror_is_read_when_the_rootfs_is_made(tmp_path, monkeypatch):
    root = _machine(tmp_path, {"etc/apt/sources.list.d/debian.sources": DEB822})
    monkeypatch.setenv("KVWARM_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert image_standin.debian_mirror(root) == "http://mirror.example/debian"
    monkeypatch.delenv("KVWARM_DEBIAN_MIRROR")
    assert image_standin.debian_mirror(root) == "http://mirror.example/debian"


# --- no registry host in the tree -----------------------------------------------------------


def test_no_package_index_or_debian_mirror_host_is_named_in_the_tooling():
    """Hosts come from the user's configuration (the pattern's brackets keep this file clean too)."""
    hosts = re.compile(r"pypi[.]org|files[.]pythonhosted|deb[.]debian[.]org")
    paths = [project.ROOT / "noxfile.py", project.ROOT / "pyproject.toml"]
    paths += [p for folder in ("tooling", "tests") for p in sorted((project.ROOT / folder).rglob("*.py"))]
    found = [f"{path.relative_to(project.ROOT)}" for path in paths if hosts.search(path.read_text())]
    assert found == []


def test_a_full_disk_gets_a_space_fix_not_an_index_fix(tmp_path):
    """uv's words when a CI host's disk filled during a wheel install (seen in CI): the fix
    names the space left and where, not the package index."""
    index_fix = "check network access to the package index and retry"
    full = (
        "error: Failed to install: vllm-9.9.1+kvwarm.1-cp38-abi3-manylinux_2_28_x86_64.whl\n"
        "  cause: failed to copy file from /tmp/.tmpPMZsak/archive-v0/x.py to /v/.tmpxt1XRh: "
        "No space left on device (os error 28)"
    )
    venv = tmp_path / "venv"
    fix = failure_fix(full, index_fix, venv)
    assert fix.startswith("free disk space (") and f"GiB free at {venv} now" in fix
    assert "KVWARM_CACHE_DIR" in fix and "index" not in fix
    assert failure_fix("error: Failed to fetch: connection refused", index_fix, venv) == index_fix
