"""Real text for the chains, from a local ShareGPT-format JSON file
(DYN_BENCH_KV_WARMUP_DATASET): a list of {"conversations": [{"from": ..., "value": ...}]}.

A conversation's turns are joined by newlines; turns shorter than 64 characters are
dropped. Conversations are split by a content hash (first byte of the text's sha256 even
or odd), so the odd half is held out for other uses and the split never depends on the
file's order. Chain i draws the even half in an order seeded by i and concatenates
tokens up to the depth asked; a deeper draw extends a shallower one, so deeper rungs
reuse the prefix (and the prefix cache) of shallower ones.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

MIN_TURN_CHARS = 64
COLLECTION_POOL = "conversation_sha256_even"


class DatasetError(ValueError):
    pass


def load_dataset(path: str | Path) -> tuple[list[str], str]:
    """The collection half of the file's conversations as text, and the sha256 of the
    file's bytes (read once)."""
    collection, _, digest = load_halves(path)
    return collection, digest


class ChainText:
    """chain_tokens(i, depth): the first `depth` tokens of chain i's draw."""

    def __init__(self, conversations: list[str], encode: Callable[[str], list[int]]):
        self._conversations, self._encode = conversations, encode
        self._tokens: dict[int, list[int]] = {}
        self._order: dict[int, list[int]] = {}

    def __call__(self, i: int, depth: int) -> list[int]:
        tokens = self._tokens.setdefault(i, [])
        order = self._order.setdefault(i, [])
        while len(tokens) < depth:
            if not order:
                order.extend(range(len(self._conversations)))
                random.Random(f"kvwarm-chain-{i}-{len(tokens)}").shuffle(order)
            tokens.extend(self._encode(self._conversations[order.pop()]))
        return tokens[:depth]


def load_halves(path: str | Path) -> tuple[list[str], list[str], str]:
    """Both halves of the file's conversations as text (collection: the chains'; held out:
    other text, e.g. prefill points' new tokens), and the sha256 of the file's bytes."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        raise DatasetError(
            f"dataset {path} not found; set DYN_BENCH_KV_WARMUP_DATASET to a ShareGPT-format JSON file"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"dataset {path} is not valid JSON: {err}") from None
    if not isinstance(data, list):
        raise DatasetError(f"dataset {path}: expected a JSON list of conversations")
    halves: tuple[list[str], list[str]] = ([], [])
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        bodies = [t.get("value", "") for t in turns if isinstance(t, dict)]
        text = "\n".join(b for b in bodies if isinstance(b, str) and len(b) >= MIN_TURN_CHARS)
        if text:
            halves[hashlib.sha256(text.encode()).digest()[0] % 2].append(text)
    if not halves[0]:
        raise DatasetError(
            f"dataset {path}: no conversation with turns of {MIN_TURN_CHARS}+ characters "
            "in the collection half; use a larger ShareGPT-format file"
        )
    return halves[0], halves[1], hashlib.sha256(raw).hexdigest()
