"""CLI: `kvpath generate` (offline generation, the first smoke test of a checkpoint).

torch is imported inside the command function so `kvpath --help` stays fast. `add_runtime_args` is shared
with `kvpath bench model` (loadgen/bench/model.py), which times the runtime with gpu/timing.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from shared.config import DEFAULT_BLOCK_SIZE
from shared.errors import InvalidRequestError, KvpathError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="offline generation with the model runtime (smoke test)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", required=True, help="smollm2, tiny, tiny-mla, an HF checkpoint folder or a .gguf file"
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    parser.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    parser.add_argument("--chat", action="store_true", help="send --prompt as a user chat message")
    parser.add_argument("--temperature", type=float, default=None, help="temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same tokens)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    add_runtime_args(parser)
    parser.set_defaults(func=_generate_command)


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default per device)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--cache-dir", default=None, help="embedded model cache dir")


def _generate_command(args: argparse.Namespace) -> int:
    def stream(text: str) -> None:
        if not args.json:
            print(text, end="", flush=True)

    try:
        token_ids, text = asyncio.run(_generate(args, stream))
    except KvpathError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text}, ensure_ascii=False))
    else:
        print()
    return 0


def _sampling(args: argparse.Namespace) -> Any:
    from gpu.sampling import SamplingOptions

    if args.temperature is None and args.top_p is None and args.seed is None:
        return SamplingOptions(temperature=0.0)
    temperature = 1.0 if args.temperature is None else args.temperature
    return SamplingOptions.seeded(
        args.seed, temperature=temperature, top_p=1.0 if args.top_p is None else args.top_p
    )


def _prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise InvalidRequestError(f"--prompt-ids must be integers: {args.prompt_ids!r}") from None
    elif args.chat:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]))
    else:
        ids = list(tokenizer.encode(args.prompt))
    if not ids:
        raise InvalidRequestError("empty prompt")
    return ids


async def _generate(args: argparse.Namespace, stream: Callable[[str], None]) -> tuple[list[int], str]:
    """Greedy (or sampled) generation of one prompt; the caller's part of the engine: stop on EOS."""
    from gpu.model_spec import load_model_spec, resolve_model
    from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
    from gpu.tokenizer import load_tokenizer

    spec = load_model_spec(args.model, args.cache_dir)
    prompt = _prompt_ids(args, load_tokenizer(resolve_model(args.model, args.cache_dir)))
    max_tokens = min(args.max_tokens, spec.max_model_len - len(prompt))
    if max_tokens <= 0:
        raise InvalidRequestError(f"prompt of {len(prompt)} tokens leaves no room in the context")
    sampling = _sampling(args)
    sampling.check()
    num_blocks = math.ceil((len(prompt) + max_tokens) / DEFAULT_BLOCK_SIZE)
    runner = ModelRunner.load(
        args.model,
        block_size=DEFAULT_BLOCK_SIZE,
        device=args.device,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        num_threads=args.threads,
        num_kv_blocks=num_blocks,
    )
    try:
        blocks = runner.kv.allocate(num_blocks)
        stop_ids = () if args.ignore_eos else runner.tokenizer.eos_token_ids
        decoder = runner.tokenizer.incremental_decoder()
        generated: list[int] = []
        token = (await runner.prefill([PrefillSeq("generate", blocks, 0, prompt, sampling=sampling)]))[0]
        while token is not None:
            generated.append(token)
            stream(decoder.push([token]))
            if token in stop_ids or len(generated) >= max_tokens:
                break
            step = DecodeSeq("generate", blocks, len(prompt) + len(generated) - 1, token, sampling=sampling)
            token = (await runner.decode([step]))[0]
        stream(decoder.flush())
        return generated, runner.tokenizer.decode(generated)
    finally:
        runner.close()
