"""A release's patch series: the `series` file, its patches, their headers, names and digest."""

from __future__ import annotations

import email.parser
import email.policy
import re
from dataclasses import dataclass
from pathlib import Path

from ..digests import digest_named
from ..errors import BuildError

UPSTREAM_STATUSES = ("Pending", "Submitted", "Accepted", "Backport", "Inappropriate", "Denied")
# Both flavours share one series; these files differ between them, so no patch may touch them.
FLAVOUR_SPECIFIC = ("vllm/_version.py", "vllm/platforms/__init__.py")
_TRAILER = re.compile(r"^(?P<key>[A-Za-z][A-Za-z-]*):\s*(?P<value>.*)$")
_NOT_IN_NAMES = re.compile(r"[^a-z0-9._]+")
# Well under the 255 bytes a file name may have; a subject is at most 72 characters anyway.
NAME_MAX = 200


@dataclass(frozen=True)
class Patch:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def data(self) -> bytes:
        return self.path.read_bytes()


@dataclass(frozen=True)
class Series:
    folder: Path
    patches: tuple[Patch, ...]

    def digest(self) -> str:
        """sha256 over the ordered patch names and bytes: what the build applied."""
        return digest_named((patch.name, patch.data()) for patch in self.patches)


def series_folder(patches_root: Path, version: str) -> Path:
    return patches_root / f"vllm-{version}"


def read_series(folder: Path) -> Series:
    """Read `series`; every entry must have a file and every .patch file an entry."""
    series_file = folder / "series"
    if not series_file.is_file():
        raise BuildError(
            f"{series_file} is missing",
            f"create it (one patch file name per line; it may be empty) in {folder}",
        )
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BuildError(f"{series_file} lists {', '.join(dupes)} more than once", "list each patch once")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise BuildError(
            f"{series_file} lists {', '.join(missing)} but no such file exists in {folder}",
            "add the patch file or remove the entry from series",
        )
    unlisted = sorted(p.name for p in folder.glob("*.patch") if p.name not in names)
    if unlisted:
        raise BuildError(
            f"{folder} has {', '.join(unlisted)} which series does not list",
            "add it to series at its place in the order, or delete the file",
        )
    return Series(folder, tuple(Patch(folder / n) for n in names))


@dataclass(frozen=True)
class Headers:
    subject: str
    trailers: dict[str, str]


def parse_headers(patch: Patch) -> Headers:
    """Subject from the mail header; DEP-3 style trailers from the message body."""
    text = patch.data().decode("utf-8", errors="replace")
    head, _, _ = text.partition("\n---\n")
    message = email.parser.Parser(policy=email.policy.default).parsestr(head)
    subject = " ".join(str(message.get("Subject", "")).split())
    trailers = {}
    body = message.get_payload() if not message.is_multipart() else ""
    for line in str(body).splitlines():
        match = _TRAILER.match(line.strip())
        if match:
            trailers[match["key"].lower()] = match["value"].strip()
    return Headers(subject, trailers)


def patch_file_name(subject: str) -> str:
    """The file name of a patch with this subject, the same on every release.

    The rule: the whole subject, lower-cased, each run of characters other than a-z, 0-9,
    "." and "_" made one "-", with "-", "." and "_" trimmed from both ends, then ".patch".
    No number (the series file holds the order, so inserting a patch renames nothing) and
    nothing cut (git format-patch cuts at 64 characters, mid-word), so a patch carried to
    another release keeps its name: `kvwarm hook: never hash the blocks of a borrowed
    request` is kvwarm-hook-never-hash-the-blocks-of-a-borrowed-request.patch everywhere.
    """
    slug = _NOT_IN_NAMES.sub("-", subject.lower()).strip("-._")
    if not slug:
        raise BuildError(f"the subject {subject!r} gives no file name", "start the subject with a word in a-z or 0-9")
    if len(slug) > NAME_MAX:
        raise BuildError(
            f"the subject {subject!r} gives a file name of {len(slug)} characters",
            f"shorten the subject (at most {NAME_MAX} characters of a-z, 0-9, '.', '_' and '-')",
        )
    return f"{slug}.patch"


def name_problems(patch: Patch, subject: str) -> list[str]:
    """The patch's file name against the rule of patch_file_name."""
    try:
        expected = patch_file_name(subject)
    except BuildError as err:
        return [f"{patch.path}: {err.problem}"]
    if patch.name == expected:
        return []
    fix = "rename the file and its series entry (tree-S then export-S rename every patch of a release)"
    return [f"{patch.path}: its subject gives the file name {expected}: {fix}"]


def header_problems(patch: Patch) -> list[str]:
    """Everything wrong with a patch's headers, as messages that name the patch."""
    headers = parse_headers(patch)
    problems = []
    where = patch.path
    if not headers.subject:
        problems.append(f"{where}: no Subject")
    else:
        problems += name_problems(patch, headers.subject)
    status = headers.trailers.get("upstream-status", "")
    if not status:
        problems.append(f"{where}: no Upstream-Status: header")
    elif status.split()[0] not in UPSTREAM_STATUSES:
        problems.append(f"{where}: Upstream-Status {status!r} is not one of {', '.join(UPSTREAM_STATUSES)}")
    if not (headers.trailers.get("origin") or headers.trailers.get("forwarded")):
        problems.append(f"{where}: neither Origin: nor Forwarded: header")
    if not headers.trailers.get("drop-when"):
        problems.append(f"{where}: no Drop-When: header saying when the patch can be dropped")
    return problems
