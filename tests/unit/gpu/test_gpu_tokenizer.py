"""Tokenizer: byte-level round trips, BOS, chat templates (config / .jinja), incremental decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu import byte_tokenizer as bt
from gpu.model_spec import resolve_model
from gpu.tokenizer import Tokenizer, load_tokenizer
from shared.errors import InvalidRequestError

TEXTS = ["hello world", "héllo wörld", "世界 and emoji 🙂👍🏽", "line\nbreak\ttab", ""]


@pytest.fixture(scope="module")
def tiny_tokenizer(model_cache: str) -> Tokenizer:
    return load_tokenizer(resolve_model("tiny", model_cache))


def test_tiny_encode_decode_round_trip(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.vocab_size == bt.VOCAB_SIZE
    assert set(tiny_tokenizer.eos_token_ids) == {bt.EOS_ID, bt.IM_END_ID}
    for text in TEXTS:
        ids = tiny_tokenizer.encode(text)
        assert ids == [bt.BOS_ID, *text.encode()]
        assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.decode([bt.BOS_ID, 104, 105], skip_special_tokens=False) == bt.BOS + "hi"


def test_chat_template(tiny_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tiny_tokenizer.apply_chat_template(messages)
    text = tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        f"{bt.BOS}{bt.IM_START}system\nbe brief{bt.IM_END}\n"
        f"{bt.IM_START}user\nhi{bt.IM_END}\n{bt.IM_START}assistant\n"
    )
    assert ids.count(258) == 3 and ids.count(bt.IM_END_ID) == 2  # specials are single tokens
    no_prompt = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert tiny_tokenizer.decode(no_prompt, skip_special_tokens=False).endswith(f"hi{bt.IM_END}\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\na\nb" in tiny_tokenizer.decode(tiny_tokenizer.apply_chat_template(parts))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
        ["not a dict"],
        [],
        "not a list",
    ],
)
def test_bad_messages_are_invalid_requests(tiny_tokenizer: Tokenizer, messages: object) -> None:
    with pytest.raises(InvalidRequestError):
        tiny_tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_incremental_decoder_holds_back_split_characters(tiny_tokenizer: Tokenizer) -> None:
    text = "a é 世 🙂!"
    decoder = tiny_tokenizer.incremental_decoder()
    pieces = []
    for byte in text.encode():  # one byte per token: multi-byte characters arrive split
        piece = decoder.push([byte])
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) + decoder.flush() == text
    assert pieces[text.encode().index("🙂".encode()) + 3] == "🙂"  # emitted with its last byte
    truncated = tiny_tokenizer.incremental_decoder()
    assert truncated.push(list("x🙂".encode())[:3]) == "x"
    assert truncated.flush() == "\ufffd"


def _write_sentencepiece_like(folder: Path) -> None:
    """A trained BPE with a Metaspace pre-tokenizer/decoder (leading-space pieces, like Llama 2)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 20 + ["hello there world"] * 5, trainer
    )
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


def test_real_style_tokenizer_with_named_template_list(tmp_path: Path) -> None:
    folder = tmp_path / "sp"
    _write_sentencepiece_like(folder)
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "add_bos_token": True,
        "chat_template": [
            {"name": "tool_use", "template": "unused"},
            {"name": "default", "template": template},
        ],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    ids = tok.encode("the quick brown fox")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "the quick brown fox"
    eos = tok.eos_token_ids[0]
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[-1] == eos and tok.decode(chat) == "user hello"
    words = tok.encode("the lazy dog jumps over the quick fox")[1:]
    decoder = tok.incremental_decoder()
    streamed = "".join(decoder.push([i]) for i in words) + decoder.flush()
    assert streamed == tok.decode(words) == "the lazy dog jumps over the quick fox"


def test_jinja_file_template_and_no_bos(tmp_path: Path) -> None:
    folder = tmp_path / "sp"
    _write_sentencepiece_like(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "bos_token": "<s>"}))
    (folder / "chat_template.jinja").write_text("{{ raise_exception('no system please') }}")
    tok = load_tokenizer(folder)
    assert tok.bos_token_id not in tok.encode("hello there")
    with pytest.raises(InvalidRequestError, match="no system please"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_missing_template_is_an_invalid_request(tmp_path: Path) -> None:
    folder = tmp_path / "sp"
    _write_sentencepiece_like(folder)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_come_from_generation_config_whatever_the_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "sp"
    _write_sentencepiece_like(folder)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["MambaForCausalLM"], "eos_token_id": 2})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert set(load_tokenizer(folder).eos_token_ids) == {1, 2}
