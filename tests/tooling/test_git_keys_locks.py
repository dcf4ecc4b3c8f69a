"""What the tooling's modules share: the one git runner, the one cache key, the venv lock."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvwarm_build import digests, project
from kvwarm_build.digests import cache_key
from kvwarm_build.errors import BuildError
from kvwarm_build.git import IDENTITY, git
from kvwarm_build.venvs import deps

# --- git ------------------------------------------------------------------------------------


def test_git_leaves_out_the_users_config_unless_asked(tmp_path, monkeypatch):
    config = tmp_path / "gitconfig"
    config.write_text("[kvwarm]\n\tprobe = from-the-user\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    assert git(tmp_path, "config", "--get", "kvwarm.probe", check=False).returncode == 1
    assert git(tmp_path, "config", "--get", "kvwarm.probe", user_config=True).stdout == "from-the-user\n"


def test_git_outside_repo_does_not_find_the_enclosing_repository(tmp_path):
    scratch = tmp_path / "repo" / "scratch"
    scratch.mkdir(parents=True)
    git(tmp_path / "repo", "init", "-q")
    assert git(scratch, "rev-parse", "--show-toplevel").stdout.strip() == str((tmp_path / "repo").resolve())
    assert git(scratch, "rev-parse", "--show-toplevel", check=False, outside_repo=True).returncode != 0


def test_git_commits_as_the_tooling_whoever_runs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_AUTHOR_NAME", "someone")
    git(tmp_path, "init", "-q")
    git(tmp_path, "commit", "-q", "--allow-empty", "-m", "x")
    author = git(tmp_path, "log", "--format=%an|%ae|%at").stdout.split()
    assert author == [f"{IDENTITY['GIT_AUTHOR_NAME']}|{IDENTITY['GIT_AUTHOR_EMAIL']}|946684800"]  # 2000-01-01


def test_a_failing_git_names_the_command_and_the_folder(tmp_path):
    with pytest.raises(BuildError) as err:
        git(tmp_path, "rev-parse", "--verify", "no-such-ref")
    assert "git rev-parse --verify no-such-ref" in err.value.problem and str(tmp_path) in err.value.problem


def test_the_project_revision_comes_from_git(monkeypatch):
    monkeypatch.delenv("KVWARM_REVISION", raising=False)
    head = subprocess.run(
        ["git", "-C", str(project.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert project.revision().removesuffix("-dirty") == head.stdout.strip()


# --- cache keys -----------------------------------------------------------------------------


def test_a_cache_key_is_a_stable_short_name_of_its_inputs_and_the_python(monkeypatch):
    key = cache_key("torch==2.0+cpu", ["a>=1", "b"], ("pin==1",))
    assert key == cache_key("torch==2.0+cpu", ["a>=1", "b"], ("pin==1",))
    assert len(key) == 12 and int(key, 16) >= 0
    assert len(cache_key("x", length=16)) == 16 and cache_key("x", length=16).startswith(cache_key("x"))
    assert key != cache_key("torch==2.0+cpu", ["a>=1"], ("pin==1",))
    assert key != cache_key("torch==2.0+cpu", ["a>=1", "b"], ("pin==2",))
    monkeypatch.setattr(digests, "sys", types.SimpleNamespace(version_info=(3, 99, 0)))
    assert cache_key("torch==2.0+cpu", ["a>=1", "b"], ("pin==1",)) != key


def test_the_venv_names_come_from_the_one_cache_key(tmp_path):
    from kvwarm_build.releases import load_releases
    from kvwarm_build.venvs.deps import deps_key
    from kvwarm_build.venvs.engine import engine_venv_path

    release = load_releases(project.RELEASES)[0]
    path = engine_venv_path(release, tmp_path, "2.0+cpu", ["a"])
    key = cache_key("2.0+cpu", ["a"], release.test_pins)
    assert path == tmp_path / "venvs" / f"engine-deps-{release.version}-{key}"
    inputs = ("2.0+cpu", ["a"], ["torch==2.0+cpu"])
    assert deps_key(inputs) == cache_key(inputs, "resolved")


# --- the venv lock --------------------------------------------------------------------------

# Two processes ask for one venv. The first (holding the lock) waits in its install step
# until the second says, through its log, that it waits for the lock; the second must then
# find the venv made and not make it again.
_RACER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from kvwarm_build.venvs import deps
venv, role, work = Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
kind = sys.argv[5]

def log(message):
    with open(work / f"{role}.log", "a") as out:
        out.write(message + "\\n")

def install(python):
    with open(work / "installs", "a") as out:
        out.write(role + "\\n")
    (work / "first-is-installing").touch()
    deadline = time.monotonic() + 120
    while "waiting for another process" not in ((work / "second.log").read_text()
                                                 if (work / "second.log").exists() else ""):
        assert time.monotonic() < deadline, "the second process never waited"
        time.sleep(0.05)

if kind == "deps":
    result = deps.ensure_venv(venv, install, "a test venv", log=log)
else:
    deps.install = lambda python, *args, log: install(python)
    result = deps.ensure_layered_venv(venv, work, [["nothing"]], log=log)
print(json.dumps(str(result)))
"""


@pytest.mark.parametrize("kind", ["deps", "layered"])
def test_two_processes_sharing_a_cache_make_a_venv_once(tmp_path, kind):
    venv, tooling = tmp_path / "cache" / "venvs" / "shared", str(project.ROOT / "tooling")

    def start(role):
        argv = [sys.executable, "-c", _RACER, tooling, str(venv), role, str(tmp_path), kind]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start("first")
    for _ in range(2400):
        if (tmp_path / "first-is-installing").exists() or first.poll() is not None:
            break
        subprocess.run(["sleep", "0.05"], check=True)
    second = start("second")
    results = [p.communicate(timeout=300) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], results
    assert (tmp_path / "installs").read_text() == "first\n"  # made once, by the lock holder
    assert json.loads(results[0][0]) == json.loads(results[1][0])
    second_log = (tmp_path / "second.log").read_text()
    assert "waiting for another process" in second_log and "creating" not in second_log
    assert Path(venv.with_name("shared.lock")).exists()


def _dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_a_layer_resolves_against_the_deps_venv_but_keeps_what_it_names(tmp_path):
    for name, version in (("Foo_Bar", "1.0"), ("baz", "2.1"), ("torch", "2.13.0+cpu")):
        _dist(tmp_path, name, version)
    assert deps.deps_constraints(tmp_path, ["pytest", "baz>=3", "-q"]) == ["foo-bar==1.0", "torch==2.13.0+cpu"]
    assert deps.deps_constraints(tmp_path, ["--no-deps", "baz==3.0"]) == []  # nothing resolved
