"""Fixtures over the real vLLM classes; the builders live in kvwarm_testing.real_kv."""

from __future__ import annotations

import gc

import pytest
import torch
from kvwarm_testing.real_kv import BLOCK_SIZE, BlockPool

# The worker's page copies run on every device this host has: CPU here, CUDA on a GPU host.
TORCH_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "long_sweep: a 10,000-point data-parallel sweep (minutes); unit-S leaves it out")


def _no_pinned_memory_without_an_accelerator() -> None:
    """Releases that ignore VLLM_TARGET_DEVICE run the cuda wheel on a CPU host under vLLM's
    unspecified platform, which says pinned memory is available; torch refuses to pin
    without an accelerator, so the worker's copies would fail there. Off, as vLLM's CPU
    platform has it."""
    from vllm.utils import torch_utils

    if not torch.cuda.is_available() and getattr(torch_utils, "PIN_MEMORY", False):
        torch_utils.PIN_MEMORY = False


_no_pinned_memory_without_an_accelerator()


@pytest.fixture(params=TORCH_DEVICES)
def torch_device(request) -> str:
    return request.param


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(32, True, hash_block_size=BLOCK_SIZE)


@pytest.fixture(autouse=True)
def _collector_back_after_each_test():
    """A test that leaves a sweep mid-point (its collector held) must not change the rest of
    the session: the collector is put back as it was."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if not frozen and gc.get_freeze_count():
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


@pytest.fixture(autouse=True)
def _rank_stores_closed(monkeypatch):
    """Every rank store a test opens is closed when the test ends: a TCPStore left to the
    interpreter's shutdown can abort the process (C++ terminate) after every test passed.
    Stock vLLM (stock-check runs the parity tests there) has no overlay and no store."""
    try:
        from vllm.kvwarm.sweep.exchange.store import StoreExchange
    except ImportError:
        yield
        return

    opened, init = [], StoreExchange.__init__

    def tracked(self, *args, **kwargs):
        opened.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(StoreExchange, "__init__", tracked)
    yield
    for exchange in opened:
        exchange.close()


@pytest.fixture
def engine_cli():
    """vLLM's engine arguments as the sweep command builds them, or a skip where this
    release's cuda wheel infers no device on a CPU host (it ignores VLLM_TARGET_DEVICE and
    add_cli_args asks the platform): the engine tier runs the command with the cpu wheel."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        EngineArgs.add_cli_args(FlexibleArgumentParser())
    except RuntimeError as err:
        if "infer device type" not in str(err):
            raise
        pytest.skip(f"this release's cuda wheel resolves no platform on a CPU host: {err}")
