"""A GGUF file's tokenizer rebuilt with HF `tokenizers`: vocabulary, merges, pre-tokenizer, special tokens.

Byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM, Qwen2, Llama 3) uses the file's merges and the
pre-tokenizer its `tokenizer.ggml.pre` names (the split rules llama.cpp applies for that name, written as the
`tokenizers` pre-tokenizer the original tokenizer.json has). SentencePiece BPE ("llama": Llama 2, Mistral)
ranks merges by the scores of the merged pieces, with byte fallback. Control and user-defined tokens
become added tokens, so chat markup such as `<|im_start|>` encodes as one id and control tokens are
skipped on decode.
"""

from __future__ import annotations

from typing import Any

from gpu.errors import UnsupportedModelError
from gpu.gguf_file import TOKEN_CONTROL, TOKEN_USER_DEFINED, TokenizerParts

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits one by one first, NFC-normalize, ignore merges of whole words)
PRE_TOKENIZERS: dict[str, tuple[str, bool, bool, bool]] = {
    "default": (_GPT2_SPLIT, False, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False, False),
    "smollm": (_GPT2_SPLIT, True, False, False),
    "starcoder": (_GPT2_SPLIT, True, False, False),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
}
SPM_SPACE = "\u2581"


def build_tokenizer(parts: TokenizerParts, source: str) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the file's."""
    if parts.model == "gpt2":
        tokenizer = _byte_level_bpe(parts, source)
    elif parts.model == "llama":
        tokenizer = _sentencepiece_bpe(parts)
    else:
        raise UnsupportedModelError(
            f"{source}: tokenizer model {parts.model!r} is not supported (gpt2 and llama are)",
            param="tokenizer.ggml.model",
        )
    _add_special_tokens(tokenizer, parts)
    return tokenizer


def _byte_level_bpe(parts: TokenizerParts, source: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if parts.pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{source}: pre-tokenizer {parts.pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}",
            param="tokenizer.ggml.pre",
        )
    split, has_digits, has_nfc, ignore_merges = PRE_TOKENIZERS[parts.pre]
    vocab = {token: i for i, token in enumerate(parts.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in parts.merges]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if has_digits else []
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if has_nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(parts: TokenizerParts) -> Any:
    """SentencePiece BPE: a merge (a, b) exists when a, b and a+b are pieces; it ranks by the score of a+b
    (higher merges first), as SentencePiece itself applies them."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {token: i for i, token in enumerate(parts.tokens)}
    scores = parts.scores or [0.0] * len(parts.tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, left, right))
    ranked.sort()
    unk = parts.tokens[parts.unk_token_id] if parts.unk_token_id is not None else None
    model = models.BPE(
        vocab, [(a, b) for _, _, a, b in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


def _add_special_tokens(tokenizer: Any, parts: TokenizerParts) -> None:
    from tokenizers import AddedToken

    special_ids = {i for i in (parts.bos_token_id, parts.unk_token_id, parts.pad_token_id) if i is not None}
    special_ids.update(parts.eos_token_ids)
    special, user = [], []
    for i, (token, kind) in enumerate(zip(parts.tokens, parts.token_types, strict=True)):
        if kind == TOKEN_CONTROL or i in special_ids:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def tokenizer_config(parts: TokenizerParts) -> dict[str, Any]:
    """The tokenizer_config.json `gpu.tokenizer.Tokenizer` reads (special token texts, add_bos_token)."""

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else parts.tokens[token_id]

    return {
        "bos_token": text(parts.bos_token_id),
        "eos_token": text(parts.eos_token_ids[0] if parts.eos_token_ids else None),
        "unk_token": text(parts.unk_token_id),
        "pad_token": text(parts.pad_token_id),
        "add_bos_token": parts.add_bos_token,
    }
