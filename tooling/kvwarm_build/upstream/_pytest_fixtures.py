"""Marker and fixtures the selected tests use that vLLM defines in its root tests/conftest.py.

That conftest is cut off (--confcutdir) because it imports most of vLLM's test
dependencies; run_suite loads this file as a plugin instead. A conftest that does
get loaded and defines the same fixture wins over these.
"""

import logging

import pytest


def pytest_configure(config):
    # Registered in vLLM's pyproject.toml, which is not copied with tests/.
    config.addinivalue_line("markers", "cpu_test: runs on CPU without accelerator kernels")


@pytest.fixture()
def caplog_vllm(caplog):
    # vLLM's logger does not propagate; caplog only sees records reaching root.
    logger = logging.getLogger("vllm")
    saved = logger.propagate
    logger.propagate = True
    try:
        yield caplog
    finally:
        logger.propagate = saved
