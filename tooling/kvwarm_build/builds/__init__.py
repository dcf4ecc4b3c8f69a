"""The build room: the patched wheel made from the release wheel and a patch series (series,
apply, repack, validate, tied together by build), every release's at once (build_all), and
the maintainer's round trip of a series (maint). It imports the venvs room (validation
installs the wheel) and the shared modules. Named builds: a folder named build is
setuptools' output, which git and ruff ignore."""
