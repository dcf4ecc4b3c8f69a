"""The Debian mirror this machine's apt reads, for debootstrap to make the stand-in base from.

apt's sources are /etc/apt/sources.list and /etc/apt/sources.list.d/*.list (one-line
format: `deb [options] URI SUITE [COMPONENT...]`) and *.sources (deb822 paragraphs with
Types, URIs, Suites and an optional Enabled: no), read in that order, the folder's files by
name. Only `deb` sources on http, https, ftp or file URIs count: debootstrap reads no others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SCHEMES = ("http://", "https://", "ftp://", "file:")
_FIELD = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9-]*):(?P<value>.*)$")


@dataclass(frozen=True)
class Source:
    uri: str
    suites: tuple[str, ...]
    file: Path


def source_files(root: Path = Path("/")) -> list[Path]:
    apt = root / "etc" / "apt"
    folder = sorted(p for p in (apt / "sources.list.d").glob("*") if p.suffix in (".list", ".sources"))
    return [p for p in [apt / "sources.list", *folder] if p.is_file()]


def _one_line(path: Path) -> list[Source]:
    sources = []
    for line in path.read_text(errors="replace").splitlines():
        words = line.split("#", 1)[0].split()  # apt ends a line at its first '#'
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # [arch=amd64 signed-by=...]
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            sources.append(Source(words[0], (words[1],), path))
    return sources


def _deb822(path: Path) -> list[Source]:
    sources = []
    for paragraph in re.split(r"\n[ \t]*\n", path.read_text(errors="replace")):
        fields: dict[str, str] = {}
        key = None
        for line in paragraph.splitlines():
            if line.startswith("#"):
                continue
            match = _FIELD.match(line)
            if match:
                key = match["key"].lower()
                fields[key] = match["value"].strip()
            elif key is not None and line[:1] in (" ", "\t"):
                fields[key] += " " + line.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = tuple(fields.get("suites", "").split())
        sources += [Source(uri, suites, path) for uri in fields.get("uris", "").split()]
    return sources


def deb_sources(root: Path = Path("/")) -> list[Source]:
    """Every enabled `deb` source on a URI debootstrap reads, in apt's order."""
    found = []
    for path in source_files(root):
        found += _deb822(path) if path.suffix == ".sources" else _one_line(path)
    return [s for s in found if s.uri.startswith(_SCHEMES)]


def _os_release(root: Path) -> dict[str, str]:
    for path in (root / "etc" / "os-release", root / "usr" / "lib" / "os-release"):
        if path.is_file():
            pairs = (line.partition("=") for line in path.read_text(errors="replace").splitlines())
            return {key: value.strip().strip("\"'") for key, eq, value in pairs if eq}
    return {}


def debian_mirror(suite: str, root: Path = Path("/")) -> str | None:
    """The URI of the first source that lists `suite` itself (bookworm, not
    bookworm-security); else, on a Debian machine (os-release ID=debian), of the first that
    lists the machine's own release, as a Debian mirror carries every current suite; else
    None."""
    sources = deb_sources(root)
    wanted = [suite]
    host = _os_release(root)
    if host.get("ID") == "debian" and host.get("VERSION_CODENAME"):
        wanted.append(host["VERSION_CODENAME"])
    for name in wanted:
        for source in sources:
            if name in source.suites:
                return source.uri.rstrip("/")
    return None
