"""The upstream room: vLLM's own CPU tests from the release sdist, stock wheel against patched
(suite selects, runs and compares; run ties them to the venvs; hf_standins and
_make_standins fake the hub models they name), the series' tests on the stock wheel
(stock_check), and what newer releases the index has (status). The files _make_standins.py,
_sitecustomize.py, _torchvision_shim.py, _cpu_platform_shim.py and _pytest_fixtures.py also
run inside the tests' venv, by path."""
