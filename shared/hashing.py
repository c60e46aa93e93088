"""Block hashes: XXH3-64 chained over the parent hash, salted by the model fingerprint.

    h_{-1} = xxh3_64(fingerprint)                       (`fingerprint_seed`)
    h_{-1} = xxh3_64(u64le(seed) || u64le(salt))          (`chain_root`, when a request carries a salt)
    h_i    = xxh3_64(u64le(h_{i-1}) || u32le(token ids of block i))

Only full blocks are hashed. The hash of block i names the whole prefix up to and including block i, so a
prompt's block hashes form a chain whose longest stored prefix is the cache hit. The salt makes two models
(or one model with another block size or KV dtype) never share a hash. Everything is fixed-width
little-endian and seedless, so every process on every host computes the same values (never `hash()`).

A cache salt (`kv_salt`: the caller's tenant and the request's `cache_salt`) changes the chain's root, so
requests share cached KV only when they carry the same salt (vLLM's rule): the KV of one tenant's prompt is
never a hit for another's, and `cached_tokens` cannot tell anyone what someone else sent. Salt 0 (no tenant,
no cache_salt) is the unsalted chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_U32_MAX = 0xFFFFFFFF
_FINGERPRINT_VERSION = "kvpath-fp1"


def fingerprint_seed(fingerprint: str) -> int:
    """h_{-1}: the 64-bit hash of the model fingerprint, parent of the first block (also in file headers)."""
    if not fingerprint:
        raise ValueError("model fingerprint must not be empty")
    return xxhash.xxh3_64_intdigest(fingerprint.encode())


def kv_salt(tenant: str, cache_salt: str) -> int:
    """The 64-bit salt of a request's block chain; 0 when it has neither a tenant nor a cache_salt."""
    if not tenant and not cache_salt:
        return 0
    return xxhash.xxh3_64_intdigest(b"kvpath-salt1\0" + tenant.encode() + b"\0" + cache_salt.encode()) or 1


def session_key(session_id: str, salt: int) -> str:
    """The session as engines and the router keep it: the client's id (`X-Session-Id` / `user`) scoped by the
    request's chain salt, so that two tenants (or two `cache_salt`s) naming the same session never share its
    binding or its resident KV, and the client's string (an e-mail in `user`, say) never reaches the bus or a
    log. "" (no session) stays "". 128 bits: no two sessions meet by chance."""
    if not session_id:
        return ""
    return xxhash.xxh3_128_hexdigest(b"kvpath-session1\0" + salt.to_bytes(8, "little") + session_id.encode())


def chain_root(seed: int, salt: int) -> int:
    """The parent of a chain's first block: the fingerprint seed, mixed with the request's salt if any."""
    if not salt:
        return seed
    return xxhash.xxh3_64_intdigest(int(seed).to_bytes(8, "little") + int(salt).to_bytes(8, "little"))


def model_fingerprint(architecture: str, *, dtype: str, block_size: int, **dims: int | str) -> str:
    """A canonical fingerprint string from what makes KV bytes incompatible between two models.

    `dims` are the KV-shaping dimensions (num_layers=, num_kv_heads=, head_dim=, ... or a weights digest);
    the order of keyword arguments does not matter.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    parts = [f"{key}={dims[key]}" for key in sorted(dims)]
    return "|".join(
        [_FINGERPRINT_VERSION, architecture, f"dtype={dtype}", f"block_size={block_size}", *parts]
    )


def _as_u32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian u32 array; out-of-range ids raise instead of wrapping."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.dtype("<u4"):
        return np.ascontiguousarray(token_ids)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    return arr.astype("<u4", copy=False)


def next_block_hash(parent: int, block_tokens: Sequence[int] | np.ndarray) -> int:
    """Hash of one full block given its parent's hash (`fingerprint_seed(...)` for the first block).

    For engines that extend a sequence block by block; the caller guarantees the block is full.
    """
    tokens = _as_u32(block_tokens)
    if tokens.size == 0:
        raise ValueError("a block has at least one token")
    h = xxhash.xxh3_64()
    h.update(int(parent).to_bytes(8, "little"))
    h.update(tokens.data)
    return h.intdigest()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, fingerprint: str, salt: int = 0
) -> list[int]:
    """One chained hash per FULL block of `token_ids` (a trailing partial block is not hashed)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = _as_u32(token_ids)
    num_blocks = tokens.size // block_size
    if num_blocks == 0:
        return []
    # one row per block: 2 u32 words for the parent hash, then the block's tokens; a row is hashed in place
    rows = np.empty((num_blocks, 2 + block_size), dtype="<u4")
    rows[:, 2:] = tokens[: num_blocks * block_size].reshape(num_blocks, block_size)
    parent_words = rows[:, :2].view("<u8").reshape(num_blocks)
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    parent = chain_root(fingerprint_seed(fingerprint), salt)
    for i in range(num_blocks):
        parent_words[i] = parent
        parent = digest(rows[i])
        out.append(parent)
    return out


def block_parents(hashes: Sequence[int], fingerprint: str, salt: int = 0) -> list[int]:
    """The parent hash of each block of a chain: its root, then the previous block's hash."""
    return [chain_root(fingerprint_seed(fingerprint), salt), *hashes[:-1]] if len(hashes) else []
