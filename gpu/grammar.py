"""Grammar-constrained decoding with llguidance: grammars from JSON schemas / Lark, per-request matchers.

No torch here (the router builds and validates grammars with it); `gpu.sampling` applies the masks. A grammar
travels as llguidance's own JSON text (`SamplingParams.grammar`); each engine request compiles it into a
`GrammarState` (about 0.5 ms for a tool schema) that yields the next token's allowed set as a bitmask
(about 15 us for a 49k vocabulary) and consumes every sampled token. Requests without a grammar never
touch this module.
"""

from __future__ import annotations

import functools
from typing import Any

from shared.errors import InvalidRequestError

# compact, single-spaced JSON: what an instruction-tuned model writes, and no room for endless whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict[str, Any] | bool, param: str = "response_format") -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid JSON schema: {exc}", param=param) from None


def lark_grammar(lark: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema_grammar({"type": "object"})


class GrammarCompiler:
    """Compiles grammars for one tokenizer. Building llguidance's tokenizer takes about 0.3 s for a 49k
    vocabulary, so it happens once, on the first grammar."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer  # gpu.tokenizer.Tokenizer

    @functools.cached_property
    def ll_tokenizer(self) -> Any:
        import llguidance

        tok = self._tokenizer
        return llguidance.LLTokenizer(
            tok.backend_json(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids) or None
        )

    def validate(self, grammar: str, param: str = "response_format") -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise InvalidRequestError(f"invalid grammar: {error}", param=param)

    def compile(self, grammar: str, param: str = "response_format") -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid grammar: {matcher.get_error()}", param=param)
        return GrammarState(matcher, self.ll_tokenizer.vocab_size)


class GrammarState:
    """One request's position in its grammar. `num_consumed` lets the owner catch up on tokens sampled
    elsewhere (a decode engine's first token came from the prefill engine)."""

    __slots__ = ("matcher", "num_consumed", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Consume the request's output tokens not yet consumed."""
        if self.num_consumed < len(output_token_ids):
            self.matcher.consume_tokens(output_token_ids[self.num_consumed :])
            self.num_consumed = len(output_token_ids)

    def advance(self, token_ids: list[int]) -> None:
        """Consume tokens generated before the request's output began (a migrated request's output so far,
        which its prompt ends with)."""
        if token_ids:
            self.matcher.consume_tokens(token_ids)

    def fill_mask(self, words: Any) -> None:
        """Write the allowed-token bitmask (int32 words, one bit per token) into `words` (a contiguous
        CPU tensor row with `data_ptr`/`numel`)."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def consume(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)
        self.num_consumed += 1

    @property
    def is_error(self) -> bool:
        return bool(self.matcher.is_error())

    @property
    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())
