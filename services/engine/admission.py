"""Checks a task must pass before an engine takes it (pure): capacity, context, vocabulary, and the KV plan.

The plan's block hashes are the router's; the engine checks them cheaply instead of recomputing the chain:
their count must be the prompt's full blocks at this engine's block size, the first must hash from this
engine's fingerprint (same model, KV dtype and block size) and the last from its parent (the chain ends on
this prompt's tokens). A plan that fails is refused as invalid: it was hashed for another KV format.
"""

from __future__ import annotations

import time
from collections.abc import Container

from services.engine.connector import KvConnector
from shared.blocks import blocks_for, max_hit_blocks
from shared.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
)
from shared.hashing import chain_root, next_block_hash
from shared.protocol import RequestPlan
from shared.protocol.tasks import READ_SIDES


def check_room(plan: RequestPlan, known_ids: Container[str], *, room: int, connector: KvConnector) -> int:
    """How many sequences the request is here (its `sampling.n` choices where the engine forks them, else
    1), once the engine can take them: its role takes n > 1 at all, none of their ids is taken, and `room`
    more sequences may queue."""
    num_choices = plan.sampling.n if connector.forks_choices else 1
    if plan.sampling.n > 1 and not connector.supports_choices:
        raise InvalidRequestError(f"n={num_choices}: this engine's role samples one choice", param="n")
    if any(plan.choice(i).request_id in known_ids for i in range(num_choices)):
        raise InvalidRequestError(f"duplicate request id {plan.request_id}", param="request_id")
    if num_choices > room:
        raise OverloadedError(f"engine queue full ({room} places left, {num_choices} asked)")
    return num_choices


def check_prompt(
    plan: RequestPlan, *, max_model_len: int, vocab_size: int, block_size: int, num_kv_blocks: int
) -> None:
    prompt, max_tokens = plan.prompt_token_ids, plan.sampling.max_tokens
    n = len(prompt)
    if plan.deadline_unix_s < time.time():
        raise DeadlineExceededError(f"request {plan.request_id} arrived past its deadline")
    if n == 0 or n + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"prompt of {n} tokens + max_tokens {max_tokens} exceeds the context of {max_model_len}",
            param="max_tokens",
        )
    if max(prompt) >= vocab_size or min(prompt) < 0:
        raise InvalidRequestError("prompt token id outside the vocabulary", param="prompt")
    if blocks_for(n + 1, block_size) > num_kv_blocks:
        raise ContextLengthExceededError(
            f"prompt of {n} tokens does not fit this engine's KV cache", param="prompt"
        )


def check_pinned(plan: RequestPlan, *, block_size: int, num_kv_blocks: int, pinned_blocks: int) -> None:
    """The prompt fits beside the blocks the engine keeps pinned (a holder's chunks, which requests do not
    free): else the engine could never schedule it, and it is refused as overloaded, so the router sends it
    to another engine instead of leaving it queued here until its deadline."""
    need = blocks_for(len(plan.prompt_token_ids) + 1, block_size)
    if pinned_blocks and need > num_kv_blocks - pinned_blocks:
        raise OverloadedError(
            f"prompt needs {need} KV blocks; {pinned_blocks} of the {num_kv_blocks} hold pinned chunks"
        )


def check_kv_plan(plan: RequestPlan, *, block_size: int, seed: int) -> None:
    """The plan's hashes and hit count fit this prompt and this engine's KV format."""
    kv, prompt = plan.kv, plan.prompt_token_ids
    hashes = kv.block_hashes
    num_blocks = len(prompt) // block_size
    if len(hashes) != num_blocks:
        raise InvalidRequestError(
            f"KV plan has {len(hashes)} block hashes; the prompt has {num_blocks} of {block_size} tokens",
            param="kv.block_hashes",
        )
    if not 0 <= kv.num_hit_blocks <= max_hit_blocks(len(prompt), block_size):
        raise InvalidRequestError(
            f"KV plan hits {kv.num_hit_blocks} blocks of this prompt", param="kv.num_hit_blocks"
        )
    if kv.read_side not in READ_SIDES:
        raise InvalidRequestError(f"KV plan read side {kv.read_side!r}", param="kv.read_side")
    if not hashes:
        return
    root = chain_root(seed, kv.salt)
    if next_block_hash(root, prompt[:block_size]) != hashes[0]:
        raise InvalidRequestError(
            "KV plan was hashed for another KV format (model, dtype or block size)", param="kv.block_hashes"
        )
    last = num_blocks - 1
    parent = hashes[last - 1] if last else root
    if next_block_hash(parent, prompt[last * block_size : num_blocks * block_size]) != hashes[last]:
        raise InvalidRequestError("KV plan block hashes do not match the prompt", param="kv.block_hashes")
