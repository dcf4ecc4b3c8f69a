"""Build tooling: turn an official vLLM release wheel into a patched `+kvwarm.N` wheel, and
everything the nox sessions do around it (docs/tooling.md). The rooms, and which way imports go:

  cli.py        `kvwarm-build` (also `python -m kvwarm_build`): the commands the sessions run
  sessions.py   which nox sessions the release table gives (noxfile.py registers them)
  gpu.py        whether this host can run the GPU smoke
  releases.py   releases.toml, the table of supported releases
  project.py    where things are in this project, and its revision
  fetch.py      hash-pinned downloads from the index pip is configured with
  digests.py    the digest of named files a build records, the key of every cache
  git.py        the one way the tooling runs git
  errors.py     BuildError, the one refusal
  builds/       the patched wheel: series (read and lint a patch series) -> apply (check the
                whole series, then patch) -> repack (labelled, reproducible wheel) -> validate
                (behaviour of the result), tied together by build; build_all (every release),
                maint (a series as commits on a pristine tree, and back)
  venvs/        the venvs vLLM runs in: deps (a deps venv per set of pins, venvs layered on it),
                engine (the CPU engine's), installer (uv, from the indexes pip is configured with)
  upstream/     vLLM's own CPU tests, stock against patched (suite, run, the offline hub
                stand-ins), stock_check (series tests fail on the stock wheel), status (newer
                upstream releases, and whether the newest series applies to them)
  images/       images/Dockerfile (dockerfile, refs, builders) on the official base or on a
                local stand-in (standin, apt_sources, host_tools)
  bundles/      offline bundles: resolve (what the target lacks), make (the folder), install
                (copied into every bundle as install.py: standard library only)

  cli, sessions -> any room; upstream, images, bundles -> builds -> venvs -> the shared modules
  (releases, project, fetch, digests, git, errors), which import no room.
"""
