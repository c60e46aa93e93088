"""A migrated request's sequence (`RequestPlan.num_resumed_tokens`): its prompt ends with the output the
client got, and the sampling state an engine builds for it is the one the lost engine had after that output:
the grammar consumed it, a seeded generator drew for it, and penalties count it as output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gpu import byte_tokenizer
from gpu.grammar import GrammarCompiler, json_schema_grammar
from gpu.tokenizer import load_tokenizer
from services.engine.sampling import new_sequence, sampling_options
from shared.protocol import RequestPlan, SamplingParams

VOCAB = byte_tokenizer.VOCAB_SIZE


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    folder: Path = tmp_path_factory.mktemp("tok")
    (folder / "tokenizer.json").write_text(byte_tokenizer.tokenizer_json())
    return GrammarCompiler(load_tokenizer(folder))


def _plan(prompt: list[int], resumed: int, **sampling: object) -> RequestPlan:
    return RequestPlan(
        request_id="r", router_id="x", prompt_token_ids=prompt, deadline_unix_s=2e9,
        sampling=SamplingParams(max_tokens=8, **sampling), num_resumed_tokens=resumed,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_seeded_generator_is_where_the_lost_engine_left_it(grammars: GrammarCompiler) -> None:
    seq = new_sequence(_plan([1, 2, 65, 66, 67], 3, temperature=1.0, seed=11), VOCAB, grammars)
    expected = random.Random(11)
    for _ in range(3):  # one draw per resumed token
        expected.random()
    assert seq.rng is not None and seq.rng.random() == expected.random()
    assert seq.output_token_ids == []  # the resumed tokens are its prompt's: only new ones stream
    greedy = new_sequence(_plan([1, 2, 65], 1, temperature=0.0, seed=11), VOCAB, grammars)
    assert greedy.rng is not None and greedy.rng.random() == random.Random(11).random()  # greedy draws none


def test_the_grammar_consumed_the_resumed_output(grammars: GrammarCompiler) -> None:
    schema = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    head = list(b'{"a": 4')  # the output the client got: the object opened, a number begun
    seq = new_sequence(_plan([1, 2, *head], len(head), grammar=schema), VOCAB, grammars)
    state = seq.grammar
    assert state is not None and not state.is_error
    fresh = grammars.compile(schema)
    assert fresh.matcher.try_consume_tokens(list(b"}")) == 0  # a fresh grammar cannot close an object
    assert state.matcher.try_consume_tokens(list(b"2}")) == 2  # the resumed one goes on from `{"a": 4`


def test_penalties_count_the_resumed_tokens_as_output(grammars: GrammarCompiler) -> None:
    plan = _plan([1, 2, 65, 66], 2, presence_penalty=1.0)
    options = sampling_options(new_sequence(plan, VOCAB, grammars))
    assert list(options.output_token_ids) == [65, 66]  # presence and frequency count them
