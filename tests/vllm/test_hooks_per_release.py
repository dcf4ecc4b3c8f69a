"""docs/hooks.md's table of the names only some releases have, against the real classes of
the installed build: each name the table marks present on this release is there, each it
marks absent is not. Every release's unit-S runs this, so the table is checked against every
release in releases.toml (a release without a column fails here)."""

from __future__ import annotations

import dataclasses
import re
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvwarm_testing.real_kv import make_request, make_scheduler, runner_output
from packaging.version import Version

HOOKS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
HEADING = "## Per release"
PRESENT, ABSENT = "yes", "—"


def per_release_table(text: str) -> tuple[list[str], dict[str, dict[str, bool]]]:
    """(the releases the table has a column for, {`Owner.name`: {release: present}}) from
    the first table under HEADING; a cell other than PRESENT or ABSENT is an error."""
    lines = text.split(HEADING, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    releases, table = header[1:], {}
    for line in rows[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = re.fullmatch(r"`([A-Za-z_][\w]*\.[A-Za-z_]\w*)`", cells[0])
        assert name, f"hooks.md {HEADING}: a row's first cell must be one `Owner.name`: {cells[0]!r}"
        bad = [c for c in cells[1:] if c not in (PRESENT, ABSENT)]
        assert not bad and len(cells) == len(header), f"hooks.md {HEADING}, {cells[0]}: cells {cells[1:]}"
        table[name[1]] = {release: cell == PRESENT for release, cell in zip(releases, cells[1:])}
    return releases, table


def _owners(tmp_path) -> dict[str, object]:
    """The live object (or class) each owner the table names stands for, in this build."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    scheduler = make_scheduler(tmp_path)
    return {
        "Scheduler": scheduler,
        "SchedulerConfig": scheduler.scheduler_config,
        "CompilationConfig": scheduler.vllm_config.compilation_config,
        "KVCacheCoordinator": scheduler.kv_cache_manager.coordinator,
        "Request": make_request("r", 4),
        "MambaManager": MambaManager,
        "ModelRunnerOutput": _runner_output_fields_stand_in(),
    }


def _runner_output_fields_stand_in() -> SimpleNamespace:
    """A stand-in for ModelRunnerOutput that has exactly its dataclass fields as attributes,
    read off this build's real class. The table names fields, and neither real object answers
    for exactly those: a field without a default is no attribute of the class, and an
    instance answers for its methods and properties too."""
    fields = {f.name for f in dataclasses.fields(type(runner_output([], [])))}
    return SimpleNamespace(**dict.fromkeys(fields))


def test_the_table_has_rows():
    releases, table = per_release_table(HOOKS.read_text())
    assert len(releases) >= 2 and len(table) >= 5


def test_this_build_has_exactly_the_names_its_column_marks_present(tmp_path):
    installed = Version(version("vllm")).base_version
    releases, table = per_release_table(HOOKS.read_text())
    if installed not in releases:
        pytest.fail(f"docs/hooks.md {HEADING} has no column for vLLM {installed}: add one from its sources")
    owners = _owners(tmp_path)
    wrong = []
    for dotted, present in table.items():
        owner, name = dotted.split(".")
        assert owner in owners, f"hooks.md {HEADING} names {owner}, which this test cannot build: add it to _owners"
        if hasattr(owners[owner], name) != present[installed]:
            wrong.append(f"{dotted}: the table says {'present' if present[installed] else 'absent'}")
    assert not wrong, f"docs/hooks.md {HEADING}, vLLM {installed}:\n" + "\n".join(wrong)
