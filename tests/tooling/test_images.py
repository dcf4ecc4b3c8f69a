"""images/Dockerfile read statically (dockerfile-parse) against releases.toml and what the
build produces, and the image tooling's pure parts: builder detection, tags, labels."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from kvwarm_build import project
from kvwarm_build.builds.build import output_name
from kvwarm_build.errors import BuildError
from kvwarm_build.images import builders as image_builders
from kvwarm_build.images import dockerfile
from kvwarm_build.images import refs as image_refs
from kvwarm_build.images import standin as image_standin
from kvwarm_build.releases import load_releases

RELEASES = load_releases(project.RELEASES)
NEWEST = RELEASES[-1]
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def parsed() -> DockerfileParser:
    return DockerfileParser(path=str(dockerfile.DOCKERFILE), env_replace=False)


def instructions(name: str) -> list[str]:
    return [i["value"] for i in parsed().structure if i["instruction"] == name]


def expand(text: str, values: dict[str, str]) -> str:
    def one(match):
        name = match.group(1) or match.group(2)
        assert name in values, f"${name} is not a declared ARG"
        return values[name]

    return _VAR.sub(one, text)


def resolved_args(build_args: dict[str, str] | None = None) -> dict[str, str]:
    """ARG values as a builder sees them: defaults in order, each expanded with the ones
    before it, a --build-arg winning over the default."""
    build_args = build_args or {}
    values: dict[str, str] = {}
    for value in instructions("ARG"):
        name, has_default, default = value.partition("=")
        if name in build_args:
            values[name] = build_args[name]
        elif has_default:
            values[name] = expand(default, values)
    return values


def release_args(release, flavour: str = "cuda") -> dict[str, str]:
    dist = output_name(release, flavour).split("-")[0]
    return {"VLLM_VERSION": release.version, "KVWARM_BUILD": str(release.build), "VLLM_DIST": dist}


# --- the Dockerfile against releases.toml and the build -------------------------------------


def test_from_defaults_to_the_newest_releases_official_image():
    (base,) = instructions("FROM")
    assert base == "${BASE_IMAGE}"
    assert resolved_args()["BASE_IMAGE"] == NEWEST.flavour("cuda").image


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.short)
def test_the_base_pattern_gives_every_releases_cuda_image(release):
    assert resolved_args(release_args(release))["BASE_IMAGE"] == release.flavour("cuda").image


def test_every_arg_has_a_default_or_inherits_a_global_one():
    values = [v for v in instructions("ARG")]
    structure = parsed().structure
    first_from = next(i for i, s in enumerate(structure) if s["instruction"] == "FROM")
    globals_ = {s["value"].partition("=")[0] for s in structure[:first_from] if s["instruction"] == "ARG"}
    for value in values:
        name, has_default, default = value.partition("=")
        assert (has_default and default) or name in globals_, f"ARG {name} has no default"


def test_the_default_wheel_is_what_build_produces_for_the_newest_release():
    assert resolved_args()["WHEEL"] == output_name(NEWEST, "cuda")


@pytest.mark.parametrize(
    "release, flavour", [(r, f) for r in RELEASES for f in r.flavours], ids=lambda v: getattr(v, "short", v)
)
def test_the_wheel_name_follows_each_release_and_flavour(release, flavour):
    assert resolved_args(release_args(release, flavour))["WHEEL"] == output_name(release, flavour)


def tooling_args(release=NEWEST) -> dict[str, str]:
    wheel = Path(output_name(release, "cuda"))
    record = {"version": release.patched_version, "series_digest": "ab" * 32}
    return image_refs.build_args(release, wheel, record, "vllm/vllm-openai@sha256:" + "0" * 64, "sha256:" + "0" * 64)


def test_the_tooling_sets_exactly_the_declared_args():
    declared = {v.partition("=")[0] for v in instructions("ARG")}
    assert set(tooling_args()) == declared


def test_labels_carry_the_oci_keys_and_the_series_digest_from_the_build_args():
    args = tooling_args()
    labels = {key: expand(value, args) for key, value in parsed().labels.items()}
    for key, value in image_refs.expected_labels(args).items():
        assert labels.get(key) == value, key
    assert labels[image_refs.SERIES_LABEL] == "ab" * 32


def test_base_image_keeps_its_entrypoint_cmd_user_and_workdir():
    used = {i["instruction"] for i in parsed().structure}
    assert not used & {"ENTRYPOINT", "CMD", "USER", "WORKDIR", "SHELL"}


def test_one_layer_installs_the_mounted_wheel_and_checks_it():
    used = [i["instruction"] for i in parsed().structure if i["instruction"] not in ("COMMENT", "ARG", "LABEL")]
    assert used == ["FROM", "RUN"]  # no COPY/ADD: the wheel never lands in a layer
    (run,) = instructions("RUN")
    assert run.startswith("--mount=type=bind,target=/tmp/kvwarm-context")
    assert '--no-deps --force-reinstall "$wheel"' in run
    assert "uv pip install $where" in run and "python3 -m pip install" in run
    assert "python3 -m vllm.kvwarm selfcheck" in run and "${KVWARM_SERIES_DIGEST}" in run


def test_a_flavour_whose_dist_is_not_vllm_gets_the_metadata_alias_before_the_selfcheck():
    (run,) = instructions("RUN")
    alias = run.index('if [ "$ours" != vllm ]; then')
    assert run.index("$install --no-deps") < alias < run.index("vllm.kvwarm selfcheck")
    body = run[alias : run.index("fi;", alias)]
    assert 'python3 "$alias" "$VLLM_DIST";' in body and 'python3 "$alias" --check "$VLLM_DIST";' in body
    assert "/tmp/kvwarm-context/" + dockerfile.DIST_ALIAS.name in body


def test_build_args_refuse_a_wheel_of_another_version():
    wheel = Path(output_name(RELEASES[0], "cuda"))
    with pytest.raises(BuildError, match=f"build-{NEWEST.short}"):
        image_refs.build_args(NEWEST, wheel, {"version": RELEASES[0].patched_version, "series_digest": "x"}, "b", "d")


# --- builder detection ----------------------------------------------------------------------


def fake_tools(folder: Path, **tools: int) -> str:
    """Executables that exit with the given code (docker's only for `buildx version`)."""
    folder.mkdir(exist_ok=True)
    for name, code in tools.items():
        script = folder / name
        script.write_text(f"#!/bin/sh\nexit {code}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(folder)


def test_no_builder_names_all_three(tmp_path):
    with pytest.raises(BuildError) as err:
        image_builders.detect_builder(path=fake_tools(tmp_path / "bin"))
    for name in ("docker buildx", "podman", "buildah"):
        assert name in str(err.value)
    assert "apt-get install -y buildah" in str(err.value)


def test_docker_without_buildx_is_not_a_builder(tmp_path):
    with pytest.raises(BuildError, match="`docker buildx version` fails"):
        image_builders.detect_builder(path=fake_tools(tmp_path / "bin", docker=1))
    assert image_builders.detect_builder(path=fake_tools(tmp_path / "bin", docker=1, buildah=0)).name == "buildah"


@pytest.mark.parametrize(
    "tools, chosen",
    [
        ({"docker": 0, "podman": 0, "buildah": 0}, "docker"),
        ({"podman": 0, "buildah": 0}, "podman"),
        ({"buildah": 0}, "buildah"),
    ],
)
def test_builder_preference(tmp_path, tools, chosen):
    assert image_builders.detect_builder(path=fake_tools(tmp_path / "bin", **tools)).name == chosen


def test_build_commands_per_builder():
    args = {"A": "1"}
    docker = image_builders.Builder("docker", ("docker",)).build_argv(Path("D"), "t", args, Path("ctx"))
    assert docker == ["docker", "buildx", "build", "--load", "-f", "D", "-t", "t", "--build-arg", "A=1", "ctx"]
    buildah = image_builders.Builder("buildah", ("buildah", "--root", "r"), ("--isolation", "chroot"))
    assert buildah.build_argv(Path("D"), "t", args, Path("ctx"))[:5] == ["buildah", "--root", "r", "bud", "--isolation"]


# --- tags, digests, times, config checks ----------------------------------------------------


def test_default_tag_and_untagged_names():
    assert (
        image_refs.default_tag(f"vllm/vllm-openai:v{NEWEST.version}", NEWEST)
        == f"vllm/vllm-openai-kvwarm:v{NEWEST.version}-{NEWEST.label}"
    )
    assert image_refs.default_tag("vllm/vllm-openai@sha256:" + "1" * 64, NEWEST).startswith("vllm/vllm-openai-kvwarm:")
    assert image_refs.untagged("registry:5000/vllm/vllm-openai:v1") == "registry:5000/vllm/vllm-openai"
    assert image_refs.untagged("registry:5000/vllm/vllm-openai") == "registry:5000/vllm/vllm-openai"


def test_short_names_are_qualified_for_podman_and_buildah():
    assert image_refs.qualified("vllm/vllm-openai:v9.9.9") == "docker.io/vllm/vllm-openai:v9.9.9"
    assert image_refs.qualified("ubuntu:24.04") == "docker.io/library/ubuntu:24.04"
    for ref in ("localhost/kvwarm-standin:9.9.9", "ghcr.io/a/b:1", "registry:5000/a/b"):
        assert image_refs.qualified(ref) == ref


def test_a_digest_pinned_base_is_kept_without_asking_the_builder():
    ref = "vllm/vllm-openai@sha256:" + "2" * 64
    assert image_refs.resolve_base(image_builders.Builder("buildah", ("false",)), ref) == (ref, "sha256:" + "2" * 64)


def test_created_follows_source_date_epoch(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert image_refs.created_time() == "2023-11-14T22:13:20Z"


def test_config_problems_name_a_changed_entrypoint_and_a_wrong_label():
    base = {"Entrypoint": ["vllm", "serve"], "Cmd": None, "User": None, "WorkingDir": "/vllm-workspace", "Labels": {}}
    built = {**base, "Entrypoint": ["bash"], "Labels": {image_refs.SERIES_LABEL: "old"}}
    problems = image_refs.config_problems(built, base, {image_refs.SERIES_LABEL: "new"})
    assert len(problems) == 2
    assert "Entrypoint" in problems[0] and "'new'" in problems[1]
    assert image_refs.config_problems(base, base, {}) == []


# --- a failing builder command names its subcommand -----------------------------------------


def test_a_failing_builder_command_names_the_subcommand_and_the_whole_command(tmp_path, monkeypatch):
    """The stand-in builder's global options (--root PATH --runroot PATH ...) come before
    the subcommand, so the message must not stop at the first few words."""
    fake_tools(tmp_path / "bin", buildah=125)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    builder = image_standin.standin_builder(tmp_path / "cache")
    with pytest.raises(BuildError) as err:
        image_standin.run_inside(builder, "localhost/some-image", [["true"]], {}, log=lambda *_: None)
    message = str(err.value)
    assert "`buildah from` failed (exit 125)" in message
    assert " ".join([*builder.command, "from", "localhost/some-image"]) in message


def test_a_failing_streamed_command_ends_its_message_with_the_last_lines_it_printed(tmp_path):
    """A CI log cut in the middle of a long build still shows why it failed."""
    script = tmp_path / "noisy"
    script.write_text(
        "#!/bin/sh\nfor i in $(seq 1 60); do echo line $i; done\necho 'no space left on device' >&2\nexit 125\n"
    )
    script.chmod(0o755)
    with pytest.raises(BuildError) as err:
        image_builders.run_command([str(script)], log=lambda *_: None, name="buildah build")
    message = str(err.value)
    assert "`buildah build` failed (exit 125)" in message
    assert "no space left on device" in message and "line 60" in message
    assert "line 1\n" not in message


def test_a_standin_build_without_room_is_refused_before_it_starts(tmp_path):
    with pytest.raises(BuildError) as err:
        image_standin.check_free_space(tmp_path, needed=2**60)
    assert str(tmp_path) in str(err.value) and "KVWARM_CACHE_DIR" in err.value.fix
    image_standin.check_free_space(tmp_path, needed=1)
