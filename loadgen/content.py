"""Deterministic synthetic prompt content.

A run of tokens is a pure function of a 64-bit key: token i of key k is `splitmix64(k + i)` folded into the
token-id range. Equal keys give equal tokens, so two prompts share a prefix exactly when their leading keys
agree (a Mooncake hash id names one key; an agent's round names another). Keys mix in a per-run salt so a
second run against the same server does not hit the first run's cache. Vectorised numpy, no Python loop
per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MASK64 = (1 << 64) - 1
KIND_APPEND = 1
KIND_GEN = 2
KIND_BLOCK = 3
KIND_PREFIX = 4

TokenArray = npt.NDArray[np.int32]

# Common words that are one token in the usual BPE vocabularies (with their leading space).
_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its "
    "about "
    "into than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three small part place found house use during "
    "without again home around however every number hand few high left water city school end large next "
    "side group point case fact head light run set change play move live give name line order open form test"
).split()


def _splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _splitmix_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix(*parts: int) -> int:
    """A 64-bit key from integers (order matters)."""
    h = 0x243F6A8885A308D3
    for part in parts:
        h = _splitmix_int(h ^ (part & MASK64))
    return h


@dataclass(slots=True, frozen=True)
class Vocab:
    """Synthetic token ids are drawn from [min_id, min_id + size)."""

    size: int = 32000
    min_id: int = 0

    def __post_init__(self) -> None:
        if self.size < 2 or self.min_id < 0:
            raise ValueError(
                f"vocab needs size >= 2 and min_id >= 0, got size={self.size} min_id={self.min_id}"
            )


def token_ids(key: int, count: int, vocab: Vocab, *, start: int = 0) -> TokenArray:
    """Tokens `start .. start+count` of the run named by `key`."""
    index = np.arange(start, start + count, dtype=np.uint64) + np.uint64(key & MASK64)
    raw = _splitmix(index)
    return (raw % np.uint64(vocab.size)).astype(np.int32) + np.int32(vocab.min_id)


def render_text(ids: TokenArray, unit: str) -> str:
    """Text standing for `ids`: `word` (about one BPE token per word) or `char` (one byte per token)."""
    if unit == "char":
        letters = (ids.astype(np.int64) % 26 + ord("a")).astype(np.uint8)
        return letters.tobytes().decode("ascii")
    if unit == "word":
        return " " + " ".join(_WORDS[int(i) % len(_WORDS)] for i in ids)
    raise ValueError(f"unknown text unit {unit!r} (word or char)")
