"""Session scripts: what each agent sends, turn by turn (pure; no I/O).

A script yields one `CallRequest` at a time; `next_call(previous)` takes the outcome of the call before, so
a trajectory can extend its context with the server's actual output (`history=output`) or with placeholder
tokens of the recorded length (`history=synthetic`, the default: reproducible and identical for every server;
the server can then reuse the previous prompt but not its own generated tokens).

Prompts are token ids (completions with `prompt` as a list of ids: exact lengths), text (completions with a
string prompt), or chat messages (a trajectory's appends become user messages and its outputs assistant
messages). `ideal_cached_tokens` is the prefix of the prompt a perfect cache could serve, computed on the
client as DualPath does (exact in token mode, None where the server's tokenization decides).

Context limit (`max_context`): a trajectory ends before the turn whose prompt plus output would not fit;
a single request (Mooncake) keeps the prefix of its prompt that fits with its output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.content import KIND_APPEND, KIND_BLOCK, KIND_GEN, TokenArray, Vocab, mix, render_text, token_ids
from loadgen.trace import BlockRequest, MessagesSession, Trajectory


@dataclass(slots=True, frozen=True)
class RenderOptions:
    endpoint: str = "completions"  # completions | chat
    prompt_format: str = "tokens"  # tokens | text (completions only)
    text_unit: str = "word"
    history: str = "synthetic"  # synthetic | output
    vocab: Vocab = field(default_factory=Vocab)
    max_context: int = 0
    length_scale: float = 1.0
    salt: int = 0

    @property
    def is_token_prompt(self) -> bool:
        return self.endpoint == "completions" and self.prompt_format == "tokens"


@dataclass(slots=True)
class CallRequest:
    session_id: str
    turn: int
    payload: dict[str, Any]  # {"prompt": ids | text} or {"messages": [...]}
    max_tokens: int
    prompt_tokens: int | None  # client-side count (exact for token prompts)
    ideal_cached_tokens: int | None
    tool_latency_s: float = 0.0


@dataclass(slots=True)
class CallOutput:
    ok: bool
    text: str = ""
    token_ids: list[int] | None = None


class SessionScript(ABC):
    session_id: str
    arrival_s: float | None
    num_calls: int  # an upper bound (a context limit can end a session early)
    history_fallbacks: int = 0  # turns that wanted the actual output but had to use placeholders

    @abstractmethod
    def next_call(self, previous: CallOutput | None) -> CallRequest | None:
        """The next request, or None when the session is over."""


@dataclass(slots=True)
class _Piece:
    role: str
    ids: TokenArray | None
    text: str | None = None

    def as_text(self, unit: str) -> str:
        if self.text is None:
            assert self.ids is not None
            self.text = render_text(self.ids, unit)
        return self.text


class TrajectoryScript(SessionScript):
    """One agent: round i's prompt is every earlier append and output, then round i's append."""

    def __init__(
        self, traj: Trajectory, session_id: str, opts: RenderOptions, arrival_s: float | None = None
    ):
        self.traj, self.session_id, self.opts, self.arrival_s = traj, session_id, opts, arrival_s
        self.num_calls = len(traj.rounds)
        self._pieces: list[_Piece] = []
        self._index = 0
        self._context_tokens = 0
        self._seen_tokens = 0  # prompt prefix the server has seen exactly (token prompts)

    def next_call(self, previous: CallOutput | None) -> CallRequest | None:
        if self._index > 0:
            self._add_output(previous)
        if self._index >= len(self.traj.rounds):
            return None
        rnd = self.traj.rounds[self._index]
        if (
            self.opts.max_context
            and self._context_tokens + rnd.append_tokens + rnd.gen_tokens > self.opts.max_context
        ):
            return None
        key = mix(
            self.opts.salt,
            KIND_APPEND,
            *((rnd.seed,) if rnd.seed is not None else (self.traj.seed, self._index)),
        )
        ids = (
            np.asarray(rnd.append_ids, dtype=np.int32)
            if rnd.append_ids
            else token_ids(key, rnd.append_tokens, self.opts.vocab)
        )
        self._pieces.append(_Piece("user", ids))
        self._context_tokens += rnd.append_tokens
        exact = self.opts.is_token_prompt
        request = CallRequest(
            self.session_id,
            self._index,
            self._payload(),
            rnd.gen_tokens,
            self._context_tokens if exact else None,
            self._seen_tokens if exact else None,
            rnd.tool_latency_s,
        )
        self._seen_tokens = self._context_tokens
        self._index += 1
        return request

    def _add_output(self, previous: CallOutput | None) -> None:
        rnd = self.traj.rounds[self._index - 1]
        actual = self.opts.history == "output" and previous is not None and previous.ok
        if actual and self.opts.is_token_prompt and previous is not None and previous.token_ids:
            piece = _Piece("assistant", np.asarray(previous.token_ids, dtype=np.int32))
            self._seen_tokens += len(previous.token_ids)
        elif actual and not self.opts.is_token_prompt and previous is not None:
            piece = _Piece("assistant", None, previous.text)
        else:
            self.history_fallbacks += int(self.opts.history == "output")
            key = mix(self.opts.salt, KIND_GEN, self.traj.seed, self._index - 1)
            piece = _Piece("assistant", token_ids(key, rnd.gen_tokens, self.opts.vocab))
        self._pieces.append(piece)
        self._context_tokens += len(piece.ids) if piece.ids is not None else rnd.gen_tokens

    def _payload(self) -> dict[str, Any]:
        if self.opts.is_token_prompt:
            return {"prompt": np.concatenate([p.ids for p in self._pieces if p.ids is not None])}
        unit = self.opts.text_unit
        if self.opts.endpoint == "completions":
            return {"prompt": "".join(p.as_text(unit) for p in self._pieces)}
        return {"messages": [{"role": p.role, "content": p.as_text(unit)} for p in self._pieces]}


class BlockScript(SessionScript):
    """One Mooncake request: the blocks named by its hash ids, scaled by `length_scale`."""

    def __init__(
        self,
        req: BlockRequest,
        session_id: str,
        opts: RenderOptions,
        *,
        cache: BlockCacheModel,
        cycle: int = 0,
        block_tokens: int = 512,
        arrival_s: float | None = None,
    ) -> None:
        self.session_id, self.opts, self.num_calls, self.arrival_s = session_id, opts, 1, arrival_s
        self._req, self._cache, self._cycle, self._block_tokens = req, cache, cycle, block_tokens
        self._done = False

    def next_call(self, previous: CallOutput | None) -> CallRequest | None:
        if self._done:
            return None
        self._done = True
        block, prompt_len, gen = scaled_block_request(
            self._req, self.opts.length_scale, self.opts.max_context, self._block_tokens
        )
        hash_ids = self._req.hash_ids[: -(-prompt_len // block)]
        ideal = self._cache.lookup_and_add(self._cycle, hash_ids, block, prompt_len)
        pieces = []
        for i, hash_id in enumerate(hash_ids):
            count = min(block, prompt_len - i * block)
            pieces.append(
                token_ids(mix(self.opts.salt, KIND_BLOCK, self._cycle, hash_id), count, self.opts.vocab)
            )
        ids = np.concatenate(pieces)
        if self.opts.is_token_prompt:
            payload: dict[str, Any] = {"prompt": ids}
        elif self.opts.endpoint == "completions":
            payload = {"prompt": render_text(ids, self.opts.text_unit)}
        else:
            payload = {"messages": [{"role": "user", "content": render_text(ids, self.opts.text_unit)}]}
        exact = self.opts.is_token_prompt
        return CallRequest(
            self.session_id, 0, payload, gen, prompt_len if exact else None, ideal if exact else None
        )


def scaled_block_request(
    req: BlockRequest, scale: float, max_context: int, block_tokens: int = 512
) -> tuple[int, int, int]:
    """(block size, prompt tokens, output tokens) after length scaling and the context limit."""
    block = max(1, round(block_tokens * scale))
    n_blocks = len(req.hash_ids)
    prompt = min(max(round(req.input_tokens * scale), (n_blocks - 1) * block + 1), n_blocks * block)
    gen = max(1, round(req.output_tokens * scale))
    if max_context and prompt + gen > max_context:
        gen = min(gen, max(1, max_context // 4))
        prompt = max(1, max_context - gen)
    return block, prompt, gen


class BlockCacheModel:
    """A perfect, never-evicting prefix cache over every block sent so far (ideal hit length per request)."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def lookup_and_add(self, cycle: int, hash_ids: tuple[int, ...], block: int, prompt_len: int) -> int:
        full = prompt_len // block
        hits = 0
        while hits < full and (cycle, hash_ids[hits]) in self._seen:
            hits += 1
        self._seen.update((cycle, h) for h in hash_ids[:full])
        return hits * block


class MessagesScript(SessionScript):
    """Recorded chat calls sent as recorded; only their output lengths are enforced."""

    def __init__(
        self, session: MessagesSession, session_id: str, output_tokens: list[int], arrival_s: float | None
    ):
        self.session_id, self.arrival_s, self.num_calls = session_id, arrival_s, len(session.calls)
        self._session, self._outputs, self._index = session, output_tokens, 0

    def next_call(self, previous: CallOutput | None) -> CallRequest | None:
        if self._index >= len(self._session.calls):
            return None
        call = self._session.calls[self._index]
        request = CallRequest(
            self.session_id,
            self._index,
            {"messages": call.messages},
            self._outputs[self._index],
            None,
            None,
            call.tool_latency_s,
        )
        self._index += 1
        return request
