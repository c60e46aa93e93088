"""Tokenizer: HF `tokenizers` (tokenizer.json) plus the checkpoint's chat template. No torch.

Used by the router (chat templates, prompt token ids) and by engines (streaming detokenization).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu import chat_template
from gpu.arch_config import read_json
from gpu.errors import CheckpointError
from gpu.gguf_file import is_gguf, tokenizer_parts
from shared.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
GIL_FREE_CHARS = 4096  # texts at least this long are encoded with the GIL released


class Tokenizer:
    """Encode/decode with one checkpoint's tokenizer. Thread-safe (the Rust tokenizer is)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        tokenizer_config: dict[str, Any],
        template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._hf = hf_tokenizer
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self._special = {
            key: _token_text(tokenizer_config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_token_id = self._token_id(self._special["bos_token"])
        self._add_bos: bool | None = tokenizer_config.get("add_bos_token")
        eos_ids = list(extra_eos_token_ids)
        eos_id = self._token_id(self._special["eos_token"])
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.chat_template = template

    def _token_id(self, text: str | None) -> int | None:
        return None if text is None else self._hf.token_to_id(text)

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)
        # `encode` holds the GIL throughout, `encode_batch` releases it: a thread encoding a long prompt
        # leaves the caller's event loop running (the same ids)
        return list(self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to: a text of more than n times this many characters
        (each at least one byte) has more than n tokens, known without encoding it."""
        return max(len(self.token_text(i).encode()) for i in range(self.vocab_size))

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt, BOS included when the tokenizer's config asks for it."""
        if self._add_bos is None:
            return self._encode(text, add_special_tokens=True)
        ids = self._encode(text, add_special_tokens=False)
        if self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def backend_json(self) -> str:
        """The tokenizers tokenizer as tokenizer.json text (what llguidance builds its token trie from)."""
        return str(self._hf.to_str())

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (OpenAI's logprobs `token`)."""
        return str(self._hf.decode([token_id], skip_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template has its own way of showing `tools` to the model."""
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render `messages` with the chat template and encode the result (the template adds BOS itself)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode_rendered(text)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The text the chat template makes of `messages` (`encode_rendered` gives its ids)."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use the completions API", param="messages"
            )
        normalized = chat_template.normalize_messages(messages)
        special = {k: v or "" for k, v in self._special.items()}
        return chat_template.render(
            self.chat_template,
            normalized,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **special,
        )

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat (its template wrote any BOS)."""
        return self._encode(text, add_special_tokens=False)

    def incremental_decoder(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streams text token by token. Decodes a short window of already-emitted tokens together with the new
    ones so that tokenizers whose pieces depend on their left neighbour (leading spaces) come out right, and
    holds back trailing U+FFFD (an incomplete UTF-8 character) until its remaining bytes arrive."""

    __slots__ = ("_ids", "_pending_chars", "_prefix_offset", "_read_offset", "_skip_special", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already emitted)
        self._read_offset = 0  # end of the committed, fully emitted tokens
        self._pending_chars = 0  # chars emitted from tokens after _read_offset (before an incomplete char)

    def push(self, token_ids: Sequence[int]) -> str:
        """New text since the last push ("" while only an incomplete character is new)."""
        self._ids.extend(token_ids)
        return self._emit(is_final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(is_final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, *, is_final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        is_incomplete = full.endswith(REPLACEMENT_CHAR) and not is_final
        stable = full.rstrip(REPLACEMENT_CHAR) if is_incomplete else full
        start = len(prefix) + self._pending_chars
        new_text = stable[start:] if len(stable) > start else ""
        if is_incomplete:
            self._pending_chars += len(new_text)
        else:
            self._commit()
        return new_text

    def _commit(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pending_chars = 0
        if self._prefix_offset > 0:  # keep only the context window
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    from gpu.arch_config import read_eos_token_ids

    model_dir = Path(model_dir)
    if is_gguf(model_dir):
        return _load_gguf_tokenizer(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
    config_path = model_dir / "tokenizer_config.json"
    tok_config = read_json(config_path) if config_path.is_file() else {}
    template = chat_template.find_chat_template(model_dir, tok_config)
    eos_ids = read_eos_token_ids(model_dir)
    return Tokenizer(hf, tokenizer_config=tok_config, template=template, extra_eos_token_ids=eos_ids)


def _load_gguf_tokenizer(path: Path) -> Tokenizer:
    from gpu.gguf_tokenizer import build_tokenizer, tokenizer_config

    parts = tokenizer_parts(path)
    return Tokenizer(
        build_tokenizer(parts, str(path)),
        tokenizer_config=tokenizer_config(parts),
        template=parts.chat_template,
        extra_eos_token_ids=parts.eos_token_ids,
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None
