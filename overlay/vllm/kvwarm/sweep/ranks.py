"""Which data-parallel rank this sweep runs on (its layout, and the DP size the engine was
launched with), and what the ranks' meetings share: how long a rank waits for the others at
one boundary, and the failure that stops every rank. How the ranks meet: sweep.exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import DEFAULT_RANK_TIMEOUT

DEFAULT_TIMEOUT = float(DEFAULT_RANK_TIMEOUT)  # seconds a rank waits for the others at one boundary

# The data-parallel size this engine process was launched with: vLLM resets a dense
# model's ranks to DP=1 before the engine core (and the scheduler) is built, so the
# series' hook in the engine-core launcher records it here first (docs/hooks.md).
_launch_data_parallel_size: int | None = None


def note_launch(data_parallel_size: int) -> None:
    global _launch_data_parallel_size
    _launch_data_parallel_size = int(data_parallel_size)


@dataclass(frozen=True)
class RankLayout:
    """The engine's parallel layout as the sweep records it."""

    data_parallel_size: int
    data_parallel_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def rank_layout(parallel_config) -> RankLayout:
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = parallel_config.data_parallel_rank
    size = max(parallel_config.data_parallel_size, _launch_data_parallel_size or 1)
    return RankLayout(
        size,
        int(rank),
        parallel_config.tensor_parallel_size,
        parallel_config.pipeline_parallel_size,
        bool(parallel_config.enable_expert_parallel),
    )


class RankFailed(RuntimeError):
    """Another rank failed, disagreed, or never reached a boundary: this rank stops too."""
