"""The engine's whole-prompt buffers (DE buffer, PE staging and receive area, session staging) default to
room for two prompts of the model's full length: a fixed 256 MiB held 5,800 tokens of SmolLM2's fp32 KV,
under its 8,192-token context, and a disaggregated cluster refused every longer prompt (429), however idle."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig, prompt_buffer_bytes
from shared.blocks import CONTEXT_BUFFER_CEILING as PROMPT_BUFFER_CEILING
from shared.blocks import CONTEXT_BUFFER_FLOOR as PROMPT_BUFFER_FLOOR
from shared.errors import ConfigError

SMOLLM2_BLOCK = 30 * 64 * 1536  # fp32: 30 layers x 64 tokens x 1,536 bytes


def test_a_default_prompt_buffer_holds_two_full_length_prompts() -> None:
    assert prompt_buffer_bytes(0, SMOLLM2_BLOCK, 8192, 64) == 2 * 128 * SMOLLM2_BLOCK > PROMPT_BUFFER_FLOOR
    assert prompt_buffer_bytes(0, 64 * 2048, 8192, 64) == PROMPT_BUFFER_FLOOR  # tiny: the floor
    assert prompt_buffer_bytes(0, SMOLLM2_BLOCK, 8000, 64) == 2 * 125 * SMOLLM2_BLOCK  # a partial last block
    assert prompt_buffer_bytes(0, SMOLLM2_BLOCK, 131_072, 64) == PROMPT_BUFFER_CEILING  # long contexts: 4 GiB
    assert prompt_buffer_bytes(12345, SMOLLM2_BLOCK, 8192, 64) == 12345  # the operator's value wins


def test_the_buffers_default_to_sized_by_the_model_and_refuse_negative_sizes() -> None:
    config = EngineConfig(model="tiny", role="decode")
    config.validate()
    assert (config.de_buffer_bytes, config.pe_staging_bytes, config.kv_cache_bytes) == (0, 0, 0)
    with pytest.raises(ConfigError, match="de_buffer_bytes"):
        EngineConfig(model="tiny", role="decode", de_buffer_bytes=-1).validate()
