"""`kvpath bench agent`: issue 12's "done when", measured against a running kvpath with the official `openai`
client (a test/bench-only dependency: the `test` extra of pyproject.toml, never imported by the services).

  agent loop   3 tools, 5 turns, streamed (`tool_choice` auto, then required): every call's arguments
               parse and validate against the called function's JSON schema
  json_schema  `response_format` json_schema (strict), N samples at temperature 1: every one schema-valid
  logprobs     (--reference) greedy tokens and their logprobs through the API next to transformers loading
               the same GGUF file: the largest |difference| (done when < 1e-3)
  choices      one long prompt, n=1 and n=N streamed: with the prompt's KV shared, N choices cost one
               prefill (time to every choice's first token about the same as one choice's)
  timing       TTFT and decode tokens/s of a streamed greedy answer, and the same answer under a JSON-schema
               grammar: the difference of their inter-token times is the grammar's cost per token end to end
  context      one session with a long context (loadgen/bench/agent_context.py): each later turn must hit
               >= 90% of its prompt in the KV store; --context-sessions N runs N at once

Prints a summary, writes everything with --json, exits 1 when an item fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from loadgen.bench.agent_context import concurrent_sessions
from loadgen.bench.agent_context import summary_line as context_summary

PARTS = ("agent", "json", "choices", "timing", "logprobs", "context")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
NOW = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
    for n, d, p in (
        ("get_weather", "Current weather in a city.", WEATHER),
        ("add", "Add two numbers.", ADD),
        ("now", "The current date and time.", NOW),
    )
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_RESULTS = {"get_weather": '{"temperature": 18, "sky": "cloudy"}', "add": '{"sum": 42}', "now": '"09:30"'}
QUESTIONS = [
    "What is the weather in Paris right now, in celsius?",
    "Please add 17 and 25.",
    "What time is it?",
    "And the weather in Tokyo, in fahrenheit?",
    "Add 2.5 and 4.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
LONG_TEXT = {  # keeps a constrained answer going for the timing run
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "agent", help="issue 12's done-when: tools, json_schema, logprobs (openai client)"
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--turns", type=int, default=5, help="turns of the agent loop")
    p.add_argument("--samples", type=int, default=100, help="json_schema samples at temperature 1")
    p.add_argument("--n", type=int, default=10, help="choices per json_schema request")
    p.add_argument("--choices", type=int, default=8, help="n of the shared-prompt run")
    p.add_argument("--choices-prompt-words", type=int, default=300, help="words of its prompt")
    p.add_argument("--timing-tokens", type=int, default=64, help="tokens of each timed answer")
    p.add_argument("--timing-runs", type=int, default=3, help="timed answers of each kind")
    p.add_argument("--reference", action="store_true", help="compare logprobs with transformers (smollm2)")
    p.add_argument("--context-tokens", type=int, default=3000, help="context of the long-context session")
    p.add_argument("--context-turns", type=int, default=6, help="turns of the long-context session")
    p.add_argument("--context-sessions", type=int, default=1, help="long-context sessions at once")
    p.add_argument("--only", default="", help=f"comma-separated parts: {', '.join(PARTS)}")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = asyncio.run(run_bench(args))
    except Exception as exc:  # a bench: one line, not a traceback
        print(f"kvpath bench agent: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(format_summary(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    url = args.url.rstrip("/")
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        models = (await client.models.list()).data
        model = args.model or models[0].id
        vocab = next((int((m.model_extra or {}).get("vocab_size", 0)) for m in models if m.id == model), 0)
        out: dict[str, Any] = {"model": model, "url": url}
        parts = set(args.only.split(",")) if args.only else set(PARTS)
        if "agent" in parts:
            out["agent_auto"] = await agent_loop(client, model, args.turns, "auto")
            out["agent_required"] = await agent_loop(client, model, args.turns, "required")
        if "json" in parts:
            out["json_schema"] = await json_samples(client, model, args.samples, args.n)
        if "choices" in parts:
            out["choices"] = await shared_prompt(client, model, args.choices, args.choices_prompt_words)
        if "timing" in parts:
            out["timing"] = await timing(client, model, args.timing_tokens, args.timing_runs)
        if args.reference and "logprobs" in parts:
            out["logprobs"] = await logprobs_vs_transformers(client, model)
        if "context" in parts:
            sizes = (args.context_tokens, args.context_turns, args.context_sessions)
            out["context"] = await concurrent_sessions(client, model, *sizes, vocab_size=vocab)
    out["ok"] = _passed(out)
    return out


def _passed(out: dict[str, Any]) -> bool:
    agent = [out[k] for k in ("agent_auto", "agent_required") if k in out]
    calls_ok = all(a["num_invalid_calls"] == 0 for a in agent)
    if "agent_required" in out:
        calls_ok = calls_ok and out["agent_required"]["num_calls"] > 0
    schema = out.get("json_schema", {"num_valid": 0, "num_samples": 0})
    logprobs_ok = "logprobs" not in out or out["logprobs"]["max_abs_diff"] < 1e-3
    context_ok = "context" not in out or out["context"]["ok"]
    return calls_ok and schema["num_valid"] == schema["num_samples"] and logprobs_ok and context_ok


# ------------------------------------------------------------------------------------------ agent loop


async def agent_loop(client: Any, model: str, turns: int, tool_choice: str) -> dict[str, Any]:
    """`turns` streamed turns; each turn asks the next question, runs the calls the model makes (canned
    results) and lets the model answer them in the same turn's follow-up request."""
    system = "You are an assistant that answers by calling tools: call one whenever a tool can answer."
    messages: list[Any] = [{"role": "system", "content": system}]
    calls: list[dict[str, Any]] = []
    finishes: list[str | None] = []
    started = time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        text, turn_calls, finish = await _stream_turn(client, model, messages, tool_choice, seed=turn)
        calls += [dict(c, turn=turn, valid=_is_valid(c)) for c in turn_calls]
        history = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in turn_calls
        ]
        messages.append(
            {"role": "assistant", "content": text or None, **({"tool_calls": history} if history else {})}
        )
        for c in turn_calls:
            messages.append(
                {"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULTS.get(c["name"], "{}")}
            )
        finishes.append(finish)
    return {
        "tool_choice": tool_choice,
        "turns": turns,
        "num_calls": len(calls),
        "num_invalid_calls": sum(not c["valid"] for c in calls),
        "finish_reasons": finishes,
        "calls": calls,
        "seconds": round(time.perf_counter() - started, 2),
    }


async def _stream_turn(
    client: Any, model: str, messages: list[Any], tool_choice: str, seed: int
) -> tuple[str, list[dict[str, Any]], str | None]:
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0.7, seed=seed,
        max_tokens=256, parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    text, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def _is_valid(call: dict[str, Any]) -> bool:
    import jsonschema

    schema = SCHEMAS.get(call["name"])
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema or {"not": {}})
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ----------------------------------------------------------------------------------------- json_schema


async def json_samples(client: Any, model: str, samples: int, n: int) -> dict[str, Any]:
    """`samples` answers at temperature 1 under a strict json_schema, `n` choices per request."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person: name, age, city and hobbies, as JSON."}]

    async def request(seed: int, count: int) -> list[Any]:
        out = await client.chat.completions.create(
            model=model, messages=messages, n=count, seed=seed, temperature=1, max_tokens=160,
            response_format=fmt,
        )  # fmt: skip
        return list(out.choices)

    started = time.perf_counter()
    sizes = [min(n, samples - i) for i in range(0, samples, n)]
    batches = await asyncio.gather(*(request(1000 + i, size) for i, size in enumerate(sizes)))
    choices = [c for batch in batches for c in batch]
    valid, errors = 0, []
    for choice in choices:
        try:
            jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            errors.append(f"{choice.finish_reason}: {str(exc)[:120]}")
    return {
        "num_samples": len(choices),
        "num_valid": valid,
        "num_distinct": len({c.message.content for c in choices}),
        "finish_reasons": {
            r: sum(c.finish_reason == r for c in choices) for r in {c.finish_reason for c in choices}
        },
        "errors": errors[:5],
        "example": choices[0].message.content if choices else "",
        "seconds": round(time.perf_counter() - started, 2),
    }


# --------------------------------------------------------------------------------------------- choices


async def shared_prompt(client: Any, model: str, n: int, words: int) -> dict[str, Any]:
    """The same long prompt (a fresh one each run: no cached prefix) with 1 choice, then `n`."""
    runs = {}
    for count in (1, n):
        prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i % 97}" for i in range(words))
        started = time.perf_counter()
        first: dict[int, float] = {}
        prompt_tokens = 0
        stream = await client.completions.create(
            model=model, prompt=prompt, n=count, max_tokens=8, temperature=1, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                first.setdefault(choice.index, time.perf_counter() - started)
        runs[f"n{count}"] = {
            "prompt_tokens": prompt_tokens,
            "all_first_tokens_ms": round(1000 * max(first.values()), 1),
            "total_ms": round(1000 * (time.perf_counter() - started), 1),
        }
    return runs


# ---------------------------------------------------------------------------------------------- timing


async def timing(client: Any, model: str, num_tokens: int, runs: int) -> dict[str, Any]:
    """Streamed greedy answers of `num_tokens` tokens, free and under a JSON-schema grammar."""
    free = [await _timed(client, model, num_tokens, None) for _ in range(runs)]
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG_TEXT, "strict": True}}
    constrained = [await _timed(client, model, num_tokens, fmt) for _ in range(runs)]
    best_free = min(r["itl_ms"] for r in free)
    best_constrained = min(r["itl_ms"] for r in constrained)
    return {
        "free": free,
        "constrained": constrained,
        "ttft_ms": [r["ttft_ms"] for r in free],
        "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in free],
        "grammar_ms_per_token": round(best_constrained - best_free, 3),
    }


async def _timed(client: Any, model: str, num_tokens: int, fmt: Any) -> dict[str, float]:
    extra: dict[str, Any] = {"ignore_eos": True} if fmt is None else {}
    started = time.perf_counter()
    stamps: list[float] = []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=num_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body=extra, **({"response_format": fmt} if fmt is not None else {}),
    )  # fmt: skip
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    ttft = stamps[0] - started
    decode_s = stamps[-1] - stamps[0]
    return {
        "tokens": tokens,
        "ttft_ms": round(1000 * ttft, 1),
        "itl_ms": round(1000 * decode_s / max(1, tokens - 1), 3),
        "decode_tokens_per_s": round((tokens - 1) / decode_s, 2) if decode_s > 0 else 0.0,
    }


# -------------------------------------------------------------------------------------------- logprobs


async def logprobs_vs_transformers(client: Any, model: str) -> dict[str, Any]:
    """Greedy tokens with logprobs (chat, top 5) through the API, next to transformers' log-softmax."""
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    response = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=32, temperature=0, logprobs=True, top_logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    raw = response.model_dump()
    prompt, tokens = raw["prompt_token_ids"], raw["choices"][0]["token_ids"]
    api = [entry["logprob"] for entry in raw["choices"][0]["logprobs"]["content"]]
    from gpu.reference import reference_logprobs

    reference = await asyncio.to_thread(reference_logprobs, "smollm2", prompt + tokens, len(prompt))
    chosen = [float(reference[i, t]) for i, t in enumerate(tokens)]
    greedy = [int(reference[i].argmax()) for i in range(len(tokens))]
    return {
        "num_tokens": len(tokens),
        "greedy_tokens_equal": greedy == tokens,
        "max_abs_diff": max(abs(a - b) for a, b in zip(api, chosen, strict=True)),
    }


def format_summary(out: dict[str, Any]) -> str:
    lines = [f"model {out['model']} at {out['url']}"]
    for a in (out[k] for k in ("agent_auto", "agent_required") if k in out):
        lines.append(
            f"agent loop ({a['tool_choice']}): {a['turns']} turns, {a['num_calls']} tool calls, "
            f"{a['num_invalid_calls']} invalid, finish {a['finish_reasons']}, {a['seconds']} s"
        )
    if (s := out.get("json_schema")) is not None:
        lines.append(
            f"json_schema: {s['num_valid']}/{s['num_samples']} schema-valid, {s['num_distinct']} distinct, "
            f"finish {s['finish_reasons']}, {s['seconds']} s"
        )
    if (c := out.get("choices")) is not None:
        lines.append("shared prompt: " + ", ".join(f"{k}: {v}" for k, v in c.items()))
    if (t := out.get("timing")) is not None:
        lines.append(
            f"timing: TTFT {t['ttft_ms']} ms, decode {t['decode_tokens_per_s']} tokens/s, "
            f"grammar {t['grammar_ms_per_token']:+} ms per token (end to end)"
        )
    if (lp := out.get("logprobs")) is not None:
        lines.append(
            f"logprobs vs transformers: {lp['num_tokens']} greedy tokens, equal={lp['greedy_tokens_equal']}, "
            f"max |diff| {lp['max_abs_diff']:.2e}"
        )
    if (lc := out.get("context")) is not None:
        lines.append(context_summary(lc))
    lines.append("PASS" if out["ok"] else "FAIL")
    return "\n".join(lines)
