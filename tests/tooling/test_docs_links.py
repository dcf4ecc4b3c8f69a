"""Every relative link in README.md and the pages under docs/ (docs/measurements/ included)
resolves, and so does every `docs/...` path; the pages a reader starts from stay short.

A link `[text](target)` (or an image, or a reference definition `[id]: target`) outside
code is checked when its target has no scheme: the file or folder must exist inside the
project, relative to the page that links it, and an anchor `#name` must be a heading of the
target page (or of the page itself for a bare `#name`), spelled as GitHub spells it. A
path that starts with `docs/` anywhere in a page, code included, is read from the project
root and must exist. The same holds for a `docs/PAGE.md#anchor` cited in the project's code,
tests and scripts (a comment or docstring that names where a behaviour is documented or
measured). Plain text: no vLLM, no network.

Short pages: README.md, the measurements index (today's figure of each topic; the history is
one page per topic under docs/measurements/, each linked from the index) and the two guides
(sweep.md, validate.md; their detail is in sweep-reference.md and validate-reference.md).

GitHub's heading anchors: the heading's text as rendered (markup removed, code spans kept
as written), lower-cased, every character that is not a letter, digit, underscore, space
or hyphen dropped, each space turned into a hyphen; a repeated anchor on one page gets
-1, -2, ... in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
# the pages a reader starts from, and the most lines each may have (the detail goes elsewhere)
SHORT_PAGES = {
    "README.md": (README_MAX_LINES, "move the detail into a page under docs/ and link it from the README's docs index"),
    "docs/measurements.md": (150, "keep one row per topic here and the dated sections on the topic's page"),
    "docs/sweep.md": (250, "move settings, stamps and fields into docs/sweep-reference.md and link them"),
    "docs/validate.md": (250, "move outputs, fields, the trace's format to docs/validate-reference.md and link them"),
}
TOPICS = "docs/measurements"
# where code cites the docs (this file's own examples of broken paths aside)
CODE = ("overlay", "tooling", "tests", "smoke", "benchmarks", "noxfile.py", ".ci")
CITATION = re.compile(r"(?<![\w./-])docs/[\w./-]+\.md(?:#[\w-]+)?")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CLOSING_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
DOCS_PATH = re.compile(r"(?<![\w./<>-])docs/[\w./-]*")
HTML_TAG = re.compile(r"<[^>]+>")
# Markup GitHub removes from a heading's text before it makes the anchor (outside code).
MARKUP = [
    (re.compile(r"!\[([^\]]*)\]\([^)]*\)"), r"\1"),  # image: its alt text
    (re.compile(r"\[([^\]]*)\]\([^)]*\)"), r"\1"),  # link: its text
    (re.compile(r"\[([^\]]*)\]\[[^\]]*\]"), r"\1"),  # reference link: its text
    (re.compile(r"(\*{1,3}|~~)(\S(?:.*?\S)?)\1"), r"\2"),  # *emphasis*, **strong**, ~~strike~~
    (re.compile(r"(?<!\w)(_{1,3})(\S(?:.*?\S)?)\1(?!\w)"), r"\2"),  # _emphasis_, __strong__
]


@dataclass(frozen=True)
class Line:
    number: int
    text: str
    in_code_block: bool


def lines_of(text: str) -> list[Line]:
    """The page's lines, each marked as inside a fenced code block or not."""
    lines, fence = [], None
    for number, text_line in enumerate(text.splitlines(), start=1):
        inside = fence is not None
        if fence is None:
            opened = FENCE.match(text_line)
            fence = opened.group(1) if opened else None
            inside = fence is not None
        else:
            closing = CLOSING_FENCE.fullmatch(text_line)
            if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence):
                fence = None
        lines.append(Line(number, text_line, inside))
    return lines


def heading_text(markdown: str) -> str:
    """A heading's text as GitHub renders it: code spans as written, other markup removed."""
    parts, at = [], 0
    for span in CODE_SPAN.finditer(markdown):
        parts.append(("text", markdown[at : span.start()]))
        code = span.group(2)
        if len(code) > 2 and code[0] == code[-1] == " " and code.strip():  # CommonMark: one space off each end
            code = code[1:-1]
        parts.append(("code", code))
        at = span.end()
    parts.append(("text", markdown[at:]))
    rendered = []
    for kind, piece in parts:
        if kind == "text":
            piece = HTML_TAG.sub("", piece)
            for pattern, replacement in MARKUP:
                piece = pattern.sub(replacement, piece)
            piece = piece.replace("\\", "")
        rendered.append(piece)
    return "".join(rendered).strip()


def github_slug(text: str) -> str:
    """The anchor GitHub makes of a heading's rendered text (before de-duplication)."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, a repeated one numbered as GitHub numbers it."""
    occurrences: dict[str, int] = {}
    for line in lines_of(text):
        match = None if line.in_code_block else HEADING.match(line.text)
        if not match:
            continue
        base = slug = github_slug(heading_text(match.group(2) or ""))
        while slug in occurrences:
            occurrences[base] += 1
            slug = f"{base}-{occurrences[base]}"
        occurrences[slug] = 0
    return set(occurrences)


def links_of(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and reference definition outside code."""
    found = []
    for line in lines_of(text):
        if line.in_code_block:
            continue
        prose = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line.text)
        definition = REFERENCE_DEFINITION.match(prose)
        if definition:
            found.append((line.number, definition.group(1)))
            continue
        found += [(line.number, m.group(1)) for m in INLINE_LINK.finditer(prose)]
    return found


def docs_paths_of(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every `docs/...` path in a page, code included."""
    found = []
    for line in lines_of(text):
        for match in DOCS_PATH.finditer(line.text):
            found.append((line.number, match.group(0).rstrip(".")))
    return found


def problems_of(page: Path, root: Path) -> list[str]:
    """Every link and docs/ path of `page` that does not resolve, each named with its fix."""
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(root).as_posix()
    problems = []
    for number, target in links_of(text):
        if not target or SCHEME.match(target):
            continue  # an external link (http:, mailto:, ...), or an empty one
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if resolved != root and root not in resolved.parents:
            problems.append(f"{where}:{number}: link {target!r} leaves the project; link a file inside it")
            continue
        if not resolved.exists():
            problems.append(
                f"{where}:{number}: link {target!r}: {resolved.relative_to(root)} does not exist; "
                "fix the path (it is relative to the page that links it)"
            )
            continue
        if not anchor:
            continue
        if resolved.suffix != ".md" or not resolved.is_file():
            problems.append(
                f"{where}:{number}: link {target!r} has an anchor into {resolved.relative_to(root)}, "
                "which is not a Markdown page; drop the anchor"
            )
            continue
        names = anchors(resolved.read_text(encoding="utf-8"))
        if unquote(anchor) not in names:
            problems.append(
                f"{where}:{number}: link {target!r}: no heading of {resolved.relative_to(root)} has "
                f"the anchor #{anchor}; use one of: {', '.join(sorted(names)) or '(no headings)'}"
            )
    for number, path in docs_paths_of(text):
        if not (root / path).exists():
            problems.append(f"{where}:{number}: {path} does not exist; name an existing page under docs/")
    return problems


def pages(root: Path) -> list[Path]:
    """README.md and every page under docs/, the topic pages of docs/measurements/ included."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def too_long(root: Path, limits: dict[str, tuple[int, str]]) -> list[str]:
    """Every short page over its limit, named with its count and where the detail goes."""
    problems = []
    for name, (most, fix) in limits.items():
        count = len((root / name).read_text(encoding="utf-8").splitlines())
        if count > most:
            problems.append(f"{name} has {count} lines, more than {most}: {fix}")
    return problems


def code_files(root: Path, places: tuple[str, ...]) -> list[Path]:
    """The Python, shell and TOML files (and scripts without a suffix) under `places`."""
    found = []
    for place in places:
        path = root / place
        found += [path] if path.is_file() else sorted(path.rglob("*"))
    return [f for f in found if f.is_file() and f.suffix in {".py", ".sh", ".toml", ""}]


def citations_problems(root: Path, places: tuple[str, ...]) -> list[str]:
    """Every `docs/PAGE.md#anchor` cited in the code under `places` whose page or anchor is gone."""
    problems = []
    for source in code_files(root, places):
        if source.resolve() == Path(__file__).resolve():
            continue
        text = source.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for cited in CITATION.findall(line):
                page, _, anchor = cited.partition("#")
                where = f"{source.relative_to(root).as_posix()}:{number}"
                if not (root / page).is_file():
                    problems.append(f"{where}: {page} does not exist; cite the page that holds it now")
                elif anchor and anchor not in anchors((root / page).read_text(encoding="utf-8")):
                    problems.append(
                        f"{where}: no heading of {page} has the anchor #{anchor}; cite the page that holds it"
                    )
    return problems


def unlinked_topics(root: Path, index: str, folder: str) -> list[str]:
    """Every page of `folder` that the index page `index` does not link."""
    page = root / index
    linked = {(page.parent / unquote(t.partition("#")[0])).resolve() for _, t in links_of(page.read_text("utf-8"))}
    return [
        f"{topic.relative_to(root).as_posix()} is not linked from {index}: give its topic a row there"
        for topic in sorted((root / folder).glob("*.md"))
        if topic.resolve() not in linked
    ]


# --------------------------------------------------------------------------- the project's pages


@pytest.mark.parametrize("page", pages(ROOT), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_docs_paths_resolve(page: Path) -> None:
    problems = problems_of(page, ROOT)
    assert not problems, "\n".join(problems)


def test_topic_pages_are_checked() -> None:
    checked = {page.relative_to(ROOT).as_posix() for page in pages(ROOT)}
    topics = sorted((ROOT / TOPICS).glob("*.md"))
    assert topics, f"{TOPICS}/ holds no page: the measurements' history lives there, one page per topic"
    assert {topic.relative_to(ROOT).as_posix() for topic in topics} <= checked


def test_docs_cited_in_code_resolve() -> None:
    problems = citations_problems(ROOT, CODE)
    assert not problems, "\n".join(problems)


def test_start_pages_are_short() -> None:
    problems = too_long(ROOT, SHORT_PAGES)
    assert not problems, "\n".join(problems)


def test_every_topic_page_is_in_the_measurements_index() -> None:
    problems = unlinked_topics(ROOT, "docs/measurements.md", TOPICS)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    "heading, slug",
    [
        (
            "Reading and comparing sweeps: `python -m vllm.kvwarm report`",
            "reading-and-comparing-sweeps-python--m-vllmkvwarm-report",
        ),
        (
            "vLLM's own tests: the upstream gate (`upstream-tests-S`)",
            "vllms-own-tests-the-upstream-gate-upstream-tests-s",
        ),
        ("Why `auto` is exact (measured)", "why-auto-is-exact-measured"),
        ("**vLLM 9.8.7** and *its* series", "vllm-987-and-its-series"),
        ("The [hook API](hooks.md) × 2 → done", "the-hook-api--2--done"),
        ("`kv_seed_regime` and __the__ stamps", "kv_seed_regime-and-the-stamps"),
    ],
)
def test_github_slug_of_headings(heading: str, slug: str) -> None:
    assert github_slug(heading_text(heading)) == slug


def test_repeated_headings_are_numbered_and_code_blocks_ignored() -> None:
    text = "# Steps\n\n## Steps\n\n```\n# Steps\n```\n\n## Steps ##\n\n### Other\n"
    assert anchors(text) == {"steps", "steps-1", "steps-2", "other"}


def test_checker_names_every_broken_link_and_docs_path(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Running a sweep\n\nBack to [the top](../README.md).\n")
    (tmp_path / "README.md").write_text(
        "# Project\n\n"
        "[ok](docs/guide.md#running-a-sweep) [ok too](#project) [web](https://example.invalid/x)\n"
        "[missing page](docs/nowhere.md) [missing anchor](docs/guide.md#running)\n"
        "[outside](../elsewhere.md) see `docs/gone.md` and docs/guide.md.\n"
        "`[not a link](docs/also-not-checked.md)`\n"
        "```\n[in a block](docs/nor-this.md)\n```\n"
    )
    problems = problems_of(tmp_path / "README.md", tmp_path)
    joined = "\n".join(problems)
    # a missing page, a link out of the project, an unknown anchor, and four docs/ paths that
    # do not exist (the missing page's too: it is both a link and a path)
    assert len(problems) == 7, joined
    assert "README.md:4: link 'docs/nowhere.md': docs/nowhere.md does not exist" in joined
    assert "README.md:4: docs/nowhere.md does not exist" in joined
    assert "no heading of docs/guide.md has the anchor #running" in joined and "running-a-sweep" in joined
    assert "README.md:5: link '../elsewhere.md' leaves the project" in joined
    assert "README.md:5: docs/gone.md does not exist" in joined
    assert "README.md:6: docs/also-not-checked.md does not exist" in joined
    assert "README.md:8: docs/nor-this.md does not exist" in joined
    assert problems_of(tmp_path / "docs" / "guide.md", tmp_path) == []


def test_checker_follows_links_between_a_folder_and_its_parent(tmp_path: Path) -> None:
    topics = tmp_path / "docs" / "measurements"
    topics.mkdir(parents=True)
    (tmp_path / "docs" / "measurements.md").write_text(
        "# Measurements\n\n## The host\n\n| topic | page |\n|---|---|\n| ci | [ci](measurements/ci.md#a-run) |\n"
    )
    (topics / "ci.md").write_text(
        "# CI\n\n## A run\n\nThe [host](../measurements.md#the-host), the [matrix](matrix.md#a-run) and "
        "[disk](disk.md), [a gone host](../measurements.md#the-old-host); docs/measurements/ci.md.\n"
    )
    (topics / "matrix.md").write_text("# Matrix\n\n## The matrix\n")
    problems = problems_of(topics / "ci.md", tmp_path)
    joined = "\n".join(problems)
    assert len(problems) == 3, joined
    assert "no heading of docs/measurements/matrix.md has the anchor #a-run" in joined and "the-matrix" in joined
    assert "link 'disk.md': docs/measurements/disk.md does not exist" in joined
    assert "no heading of docs/measurements.md has the anchor #the-old-host" in joined
    assert problems_of(tmp_path / "docs" / "measurements.md", tmp_path) == []
    assert unlinked_topics(tmp_path, "docs/measurements.md", "docs/measurements") == [
        "docs/measurements/matrix.md is not linked from docs/measurements.md: give its topic a row there"
    ]


def test_a_long_start_page_is_named_with_its_fix(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n" + "text\n" * 5)
    (tmp_path / "docs" / "short.md").write_text("# Short\n")
    limits = {"docs/guide.md": (5, "move the detail out"), "docs/short.md": (5, "unused")}
    assert too_long(tmp_path, limits) == ["docs/guide.md has 6 lines, more than 5: move the detail out"]


def test_a_moved_section_cited_in_code_is_named(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Settle steps\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "# see docs/guide.md#settle-steps and docs/guide.md\n"
        "# moved: docs/guide.md#the-trace, gone: docs/old.md#settle-steps\n"
    )
    assert citations_problems(tmp_path, ("pkg",)) == [
        "pkg/mod.py:2: no heading of docs/guide.md has the anchor #the-trace; cite the page that holds it",
        "pkg/mod.py:2: docs/old.md does not exist; cite the page that holds it now",
    ]
