"""A built wheel installed into several venvs is one unpack on disk, hard-linked into each;
a new build of the same name replaces that unpack and leaves the venvs on the old one whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import conftest
from conftest import make_release_wheel

from kvwarm_build.venvs.deps import install_wheel, site_packages, venv_python

KERNELS = "vllm/_C.abi3.so"


def new_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return venv_python(path)


def test_venvs_of_one_build_share_its_files_and_a_rebuild_gets_its_own(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = make_release_wheel(tmp_path)
    pythons = [new_venv(tmp_path / f"venv-{i}") for i in range(2)]
    for python in pythons:
        install_wheel(python, first, cache, log=lambda *_: None)
    kernels = [site_packages(python) / KERNELS for python in pythons]
    assert kernels[0].stat().st_ino == kernels[1].stat().st_ino  # one copy on disk
    built = kernels[0].read_bytes()
    assert built == conftest.COMPILED[KERNELS]

    monkeypatch.setitem(conftest.COMPILED, KERNELS, b"rebuilt kernels")
    (tmp_path / "rebuild").mkdir()
    second = make_release_wheel(tmp_path / "rebuild")
    assert second.name == first.name
    install_wheel(pythons[0], second, cache, log=lambda *_: None)
    assert len(list((cache / "unpacked" / first.name).iterdir())) == 1  # the old unpack dropped
    assert kernels[0].read_bytes() == b"rebuilt kernels"
    assert kernels[1].read_bytes() == built  # the other venv keeps the old build
