"""The data-parallel size an engine process was launched with: the series' rank hook calls
`vllm.kvwarm.ranks.note_launch` (this path is part of the hook API, docs/hooks.md); the sweep
reads it through sweep.ranks."""

from .sweep.provenance import note_launch

__all__ = ["note_launch"]
