"""What the data-parallel ranks' meetings share: how long a rank waits for the others at one
boundary, and the failure that stops every rank. How the ranks meet: sweep.exchange; the
rank layout a run records: sweep.provenance.
"""

from __future__ import annotations

from .settings import DEFAULT_RANK_TIMEOUT

DEFAULT_TIMEOUT = float(DEFAULT_RANK_TIMEOUT)  # seconds a rank waits for the others at one boundary


class RankFailed(RuntimeError):
    """Another rank failed, disagreed, or never reached a boundary: this rank stops too."""
