"""Block hashes: chained, salted by the fingerprint, full blocks only, identical in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from shared.hashing import (
    block_hashes,
    block_parents,
    chain_root,
    fingerprint_seed,
    kv_salt,
    model_fingerprint,
    next_block_hash,
    session_key,
)

FP = model_fingerprint("llama", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_definition_matches_the_documented_formula() -> None:
    tokens = [1, 2, 3, 4, 70000, 6, 7, 8]
    parent = xxhash.xxh3_64_intdigest(FP.encode())
    expected = []
    for i in range(2):
        data = parent.to_bytes(8, "little") + np.asarray(tokens[4 * i : 4 * i + 4], "<u4").tobytes()
        parent = xxhash.xxh3_64_intdigest(data)
        expected.append(parent)
    assert block_hashes(tokens, 4, FP) == expected
    assert fingerprint_seed(FP) == xxhash.xxh3_64_intdigest(FP.encode())


def test_full_blocks_only_and_chaining() -> None:
    tokens = list(range(11))
    hashes = block_hashes(tokens, 4, FP)
    assert len(hashes) == 2  # the trailing 3 tokens are not hashed
    assert block_hashes(tokens[:8], 4, FP) == hashes
    assert block_hashes(tokens[:3], 4, FP) == []
    # a prefix's hashes are the prefix of the longer prompt's hashes; a changed token changes every later one
    changed = block_hashes([0, 1, 2, 3, 4, 99, 6, 7], 4, FP)
    assert changed[0] == hashes[0] and changed[1] != hashes[1]
    changed_first = block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, FP)
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]


def test_incremental_form_equals_batch_form() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=64 * 9 + 5)
    batch = block_hashes(tokens, 64, FP)
    parent, incremental = fingerprint_seed(FP), []
    for i in range(9):
        parent = next_block_hash(parent, tokens[i * 64 : (i + 1) * 64].tolist())
        incremental.append(parent)
    assert incremental == batch
    assert block_parents(batch, FP) == [fingerprint_seed(FP), *batch[:-1]]
    # numpy dtypes do not change the hash
    assert block_hashes(tokens.astype(np.int32), 64, FP) == block_hashes(tokens.astype(np.uint32), 64, FP)


def test_fingerprints_salt_the_chain() -> None:
    other = model_fingerprint(
        "llama", dtype="bfloat16", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8
    )
    tokens = list(range(8))
    assert set(block_hashes(tokens, 4, FP)).isdisjoint(block_hashes(tokens, 4, other))
    # keyword order does not matter
    assert FP == model_fingerprint(
        "llama", block_size=4, head_dim=8, num_kv_heads=2, num_layers=2, dtype="float32"
    )


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="32-bit"):
        block_hashes([1, 2, 3, -1], 4, FP)
    with pytest.raises(ValueError, match="32-bit"):
        block_hashes([1, 2, 3, 2**32], 4, FP)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, FP)
    with pytest.raises(ValueError):
        block_hashes([1.5, 2.0], 1, FP)
    with pytest.raises(ValueError):
        fingerprint_seed("")


def test_same_hashes_in_another_process() -> None:
    tokens = list(range(1000, 1000 + 64 * 5))
    code = (
        "import sys, json; from shared.hashing import block_hashes; "
        f"print(json.dumps(block_hashes(list(range(1000, 1000 + 64 * 5)), 64, {FP!r})))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashing differs; block hashes must not
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, env=env
    )
    assert json.loads(out.stdout) == block_hashes(tokens, 64, FP)


def test_a_salt_moves_the_whole_chain_and_only_its_root() -> None:
    tokens = list(range(3, 3 + 4 * 16))
    plain = block_hashes(tokens, 16, "fp")
    assert kv_salt("", "") == 0 and block_hashes(tokens, 16, "fp", 0) == plain
    salts = {kv_salt("team-a", ""), kv_salt("team-b", ""), kv_salt("team-a", "x"), kv_salt("", "x")}
    assert len(salts) == 4 and 0 not in salts  # tenant and cache_salt both count; never the unsalted 0
    salted = block_hashes(tokens, 16, "fp", kv_salt("team-a", ""))
    assert not set(salted) & set(plain)
    root = chain_root(fingerprint_seed("fp"), kv_salt("team-a", ""))
    assert block_parents(salted, "fp", kv_salt("team-a", ""))[0] == root
    assert salted[0] == next_block_hash(root, tokens[:16])  # the engines extend a salted chain the same way


def test_a_session_is_scoped_by_the_chain_salt() -> None:
    """Two tenants (or two cache_salts) naming the same session get two sessions; the client's string is
    not what the bus carries; no session stays no session."""
    a, b = kv_salt("team-a", ""), kv_salt("team-b", "")
    keys = {session_key("s1", a), session_key("s1", b), session_key("s1", 0), session_key("s2", a)}
    assert len(keys) == 4 and session_key("s1", a) == session_key("s1", a)
    assert all("s1" not in k and len(k) == 32 for k in keys)
    assert session_key("", a) == ""
