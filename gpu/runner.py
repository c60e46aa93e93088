"""ModelRunner: the engine-facing API over the model, the paged KV cache, the tokenizer and the sampler.

All compute runs in the runner's single worker thread, never on the event loop. Prefill without a hook is one
thread hop; with a `LayerHook` it goes layer by layer: await `before_layer(l)` on the loop (the caller copies
layer l's cached KV into the cache there, maybe waiting for the network), compute layer l in the thread,
await `after_layer(l)` (the caller exports/streams the layer's KV). The runner never allocates or frees KV
blocks: the caller owns block tables.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from gpu.arch_config import ArchConfig
from gpu.batch import CacheGeometry, ForwardBatch, build_decode_batch, build_prefill_batch
from gpu.kv_cache import TORCH_DTYPES, PagedKVCache
from gpu.model import Transformer
from gpu.model_spec import (
    ModelSpec,
    dtype_bytes,
    engine_dtype,
    load_arch,
    resolve_device,
    resolve_model,
    served_name,
    spec_from_arch,
)
from gpu.partial_attention import PrefixAttention
from gpu.partial_attention_remote import (
    ChunkExchange,
    ExchangedPrefix,
    HeldJob,
    compute_prefix_rows,
    held_partials,
)
from gpu.partial_attention_routed import RoutedBatch
from gpu.sampling import Sampler, SampleRequest, SamplingOptions
from gpu.side_work import SideWork
from gpu.tokenizer import Tokenizer, load_tokenizer
from shared.blocks import context_buffer_bytes
from shared.errors import ConfigError, InvalidRequestError

__all__ = ["DecodeSeq", "LayerHook", "ModelRunner", "PrefillSeq", "SamplingOptions"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class PrefillSeq:
    seq_id: str
    block_ids: list[int]  # block table covering num_cached_tokens + len(token_ids) (allocated by caller)
    num_cached_tokens: int  # tokens whose KV is already in the cache OR supplied by the hook per layer
    token_ids: list[int]  # new tokens computed in this call (a chunk = a prefix of what remains)
    sample: bool = True  # False for a non-final chunk: no token sampled
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    banned_token_ids: list[int] = field(default_factory=list)  # logits -inf (min_tokens suppresses EOS/stops)
    # leading context held by another engine (a routed chunk): attention over it comes from here, and the
    # first prefix.num_tokens // block_size entries of block_ids are placeholders (kv.null_block)
    prefix: PrefixAttention | ChunkExchange | None = None
    # more samples from the last token's logits (the other choices of a request with n > 1: their own
    # generators, grammars and sinks; the bans above apply to them too); the runner fills `fork_token_ids`
    forks: list[SamplingOptions] = field(default_factory=list)
    fork_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DecodeSeq:
    seq_id: str
    block_ids: list[int]  # must have room for position num_cached_tokens
    num_cached_tokens: int  # context length before this token; its KV is written at this position
    token_id: int  # the last sampled token, fed as input
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    banned_token_ids: list[int] = field(default_factory=list)
    prefix: PrefixAttention | ChunkExchange | None = None  # as in PrefillSeq


class LayerHook:
    """Per-layer seam of layerwise prefill. Both methods are awaited on the event loop, once per layer and
    prefill call, in layer order; they must not run model compute, and may read/write only the KV of the
    blocks of `seqs` (via runner.kv) for layer `layer`.

    A hook that is not layerwise (`is_layerwise` False: it supplies every layer at once and does nothing
    after a layer, e.g. a load on the CPU, where no copy overlaps compute) gets one `before_forward` call in
    the runner's worker thread instead, and the forward runs in one thread hop, as without a hook."""

    is_layerwise = True

    def before_forward(self, seqs: Sequence[PrefillSeq]) -> None:
        """Hooks that are not layerwise: right before the forward, in the worker thread (no awaiting, no
        event-loop state): supply every layer's cached KV of the blocks of `seqs`."""

    async def before_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        """Right before layer `layer` computes: supply that layer's cached KV (kv.import_layer)."""

    async def after_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        """Right after layer `layer` wrote the new tokens' KV into the cache: export/stream it if wanted."""


class ModelRunner:
    def __init__(
        self, spec: ModelSpec, arch: ArchConfig, model: Transformer, kv: PagedKVCache, tokenizer: Tokenizer
    ) -> None:
        self.spec = spec
        self.arch = arch
        self.model = model
        self.kv = kv
        self.tokenizer = tokenizer
        self.device = kv.device
        self.dtype = kv.dtype
        self.block_size = kv.block_size
        self._geometry = CacheGeometry(
            arch.num_layers, kv.block_size, kv.num_blocks, arch.vocab_size, arch.max_position_embeddings
        )
        self._sampler = Sampler()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpath-model")
        self.side = SideWork()  # holder calls a forward blocked on routed partials runs meanwhile
        # what makes this cache's KV interchangeable with another's (salts block hashes; engines announce it)
        self.fingerprint = spec.fingerprint(self.dtype, self.block_size)
        self.kv_bytes_per_token = spec.num_layers * kv.bytes_per_token_layer
        self.compute_id = compute_id(self.device)

    @classmethod
    def load(
        cls,
        name_or_dir: str,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        block_size: int = 64,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        cache_dir: str | None = None,
        num_threads: int | None = None,
    ) -> ModelRunner:
        """Load weights and tokenizer, and allocate the paged cache (`num_kv_blocks`, or as many blocks as
        fit in `kv_cache_bytes`, or a default: shared.blocks.context_buffer_bytes, two sequences of the
        model's full length, 256 MiB to 4 GiB; a serving GPU should be given more). `device` "auto" picks
        CUDA when it is available, else the CPU."""
        device = resolve_device(device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} requested but CUDA is not available", param="device")
        dtype = engine_dtype(dtype or "", device)
        dtype_bytes(dtype)
        if num_threads:
            torch.set_num_threads(num_threads)
        model_dir = resolve_model(name_or_dir, cache_dir)
        arch = load_arch(model_dir)
        spec = spec_from_arch(served_name(name_or_dir), model_dir, arch)
        tokenizer = load_tokenizer(model_dir)  # before the weights: fail fast on a folder without one
        model = Transformer.load(model_dir, arch, device=device, dtype=TORCH_DTYPES[dtype])
        full_block_bytes = arch.num_layers * block_size * spec.kv_bytes_per_token_layer(dtype)
        context_blocks = -(-spec.max_model_len // block_size)
        num_blocks = num_kv_blocks or _default_num_blocks(kv_cache_bytes, full_block_bytes, context_blocks)
        kv = PagedKVCache(
            num_blocks=num_blocks,
            num_layers=arch.num_layers,
            block_size=block_size,
            kv_dim=arch.kv_dim,
            dtype=dtype,
            device=device,
        )
        log.info("loaded model=%s device=%s dtype=%s kv_blocks=%d", spec.name, device, dtype, num_blocks)
        return cls(spec, arch, model, kv, tokenizer)

    # ------------------------------------------------------------------------------------------ prefill

    async def prefill(self, seqs: Sequence[PrefillSeq], hook: LayerHook | None = None) -> list[int | None]:
        """Compute the new tokens' KV (written into the cache) and sample where `sample` is set."""
        # one sampled row per request: a sequence's own, then its forks' (the same logits row repeated)
        rows = [i for i, s in enumerate(seqs) if s.sample for _ in range(1 + len(s.forks))]
        requests = [r for s in seqs if s.sample for r in _requests_with_forks(s)]
        for request in requests:
            request.options.check()

        def sample(logits: torch.Tensor) -> list[int | None]:
            out: list[int | None] = [None] * len(seqs)
            if not rows:
                return out
            tokens = iter(self._sampler.sample(logits[rows], requests))
            for i, s in enumerate(seqs):
                if s.sample:
                    out[i] = next(tokens)
                    s.fork_token_ids = [next(tokens) for _ in s.forks]
            return out

        return await self._prefill(seqs, hook, all_tokens=False, finish=sample)

    async def prefill_logits(
        self, seqs: Sequence[PrefillSeq], hook: LayerHook | None = None, *, all_tokens: bool = False
    ) -> torch.Tensor:
        """fp32 logits on the CPU: of each sequence's last new token [n_seqs, V], or of every new token
        (flattened in order) [sum(len(token_ids)), V] when `all_tokens`."""
        return await self._prefill(seqs, hook, all_tokens=all_tokens, finish=lambda logits: logits.cpu())

    async def _prefill(
        self,
        seqs: Sequence[PrefillSeq],
        hook: LayerHook | None,
        *,
        all_tokens: bool,
        finish: Callable[[torch.Tensor], T],
    ) -> T:
        if not seqs:
            raise InvalidRequestError("prefill of an empty batch")
        plan = [(s.block_ids, s.num_cached_tokens, s.token_ids) for s in seqs]
        build = functools.partial(
            build_prefill_batch,
            self._geometry,
            self.model.rotary,
            plan,
            all_logits=all_tokens,
            device=self.model.device,
        )
        if any(s.prefix is not None for s in seqs):
            routed = [(s.block_ids, s.num_cached_tokens, len(s.token_ids), s.prefix) for s in seqs]
            build = functools.partial(self._routed, build, routed)
        if hook is None or not hook.is_layerwise:  # one thread hop for the whole forward
            return await self._call(self._forward, build, hook, seqs, finish)
        batch: ForwardBatch = await self._call(build)
        hidden = await self._call(self.model.embed, batch)
        for layer in range(self.arch.num_layers):
            await hook.before_layer(layer, seqs)
            hidden = await self._call(self._layer_synced, layer, hidden, batch)
            await hook.after_layer(layer, seqs)
        return await self._call(lambda: finish(self.model.logits(hidden, batch)))

    def _forward(
        self,
        build: Callable[[], ForwardBatch],
        hook: LayerHook | None,
        seqs: Sequence[PrefillSeq],
        finish: Callable[[torch.Tensor], T],
    ) -> T:
        if hook is not None:
            hook.before_forward(seqs)
        return finish(self.model.forward(build(), self.kv.tensor))

    def _layer_synced(self, layer: int, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.layer(layer, hidden, batch, self.kv.tensor)
        if self.model.device.type == "cuda":  # after_layer may hand the layer's KV to another stream/process
            torch.cuda.synchronize(self.model.device)
        return hidden

    async def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in the cache, in the worker thread (copy-on-write of a
        shared block before a step writes into the copy)."""
        await self._call(self.kv.copy_blocks, [s for s, _ in copies], [d for _, d in copies])

    # ------------------------------------------------------------------------------------------- decode

    async def decode(self, seqs: Sequence[DecodeSeq]) -> list[int]:
        """One step for many sequences of different lengths; writes each new token's KV."""
        requests = [_request(s) for s in seqs]
        for request in requests:
            request.options.check()
        return await self._call(lambda: self._sampler.sample(self._decode_logits(seqs), requests))

    async def decode_logits(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """fp32 logits [B, V] on the CPU of one decode step (KV written as by decode)."""
        return (await self._call(self._decode_logits, seqs)).cpu()

    def _decode_logits(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        if not seqs:
            raise InvalidRequestError("decode of an empty batch")
        plan = [(s.block_ids, s.num_cached_tokens, s.token_id) for s in seqs]
        batch = build_decode_batch(
            self._geometry, self.model.rotary, plan, device=self.model.device, dtype=self.model.dtype
        )
        if any(s.prefix is not None for s in seqs):
            batch = self._routed(
                lambda: batch, [(s.block_ids, s.num_cached_tokens, 1, s.prefix) for s in seqs]
            )
        return self.model.forward(batch, self.kv.tensor)

    # ------------------------------------------------------------------------------------ routed prefixes

    def _routed(
        self, build: Callable[[], ForwardBatch], seqs: list[tuple[Any, int, int, Any]]
    ) -> ForwardBatch:
        """The batch with its routed part attached: attention goes through gpu/partial_attention_routed.py
        (which gathers per sequence, so the decode gather's scratch and mask are dropped)."""
        batch = build()
        prefixes = [(ids, cached, new, self._as_prefix(p)) for ids, cached, new, p in seqs]
        batch.routed = RoutedBatch.build(prefixes, block_size=self.block_size, device=self.model.device)
        batch.context_blocks = batch.key_bias = None
        return batch

    def _as_prefix(self, prefix: PrefixAttention | ChunkExchange | None) -> PrefixAttention | None:
        if prefix is None or isinstance(prefix, PrefixAttention):
            return prefix
        return ExchangedPrefix(prefix, self.prefix_rows_now, self.model.dtype)

    def prefix_rows_now(self, token_ids: Sequence[int]) -> torch.Tensor:
        """KV rows [layers, tokens, kv_dim] of a chunk computed from position 0 into a private tensor (the
        fallback of a routed prefix). Worker thread only: it runs inside a forward."""
        return compute_prefix_rows(self.model, token_ids, self._geometry)

    async def held_partials(self, jobs: Sequence[HeldJob]) -> list[Any]:
        """A holder's answer to routed queries against its pinned chunks (one attention call per chunk
        range and layer): per job a float32 packed partial, or the reason it was refused. Posted as side
        work too: a forward of this thread blocked on other holders' partials runs it (`SideWork`)."""
        job = self.side.post(
            functools.partial(_in_inference_mode, held_partials, self.model, self.kv.tensor, jobs)
        )
        asyncio.get_running_loop().run_in_executor(self._executor, self.side.run, job)
        return list(await asyncio.wrap_future(job.future))

    # ---------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(_in_inference_mode, fn, *args))


def _in_inference_mode(fn: Callable[..., T], *args: Any) -> T:
    with torch.inference_mode():
        return fn(*args)


def _request(seq: PrefillSeq | DecodeSeq) -> SampleRequest:
    return SampleRequest(seq.seq_id, seq.sampling, seq.banned_token_ids)


def _requests_with_forks(seq: PrefillSeq) -> list[SampleRequest]:
    forks = [SampleRequest(f"{seq.seq_id}#{i}", o, seq.banned_token_ids) for i, o in enumerate(seq.forks, 1)]
    return [_request(seq), *forks]


def _default_num_blocks(kv_cache_bytes: int | None, full_block_bytes: int, context_blocks: int) -> int:
    """`context_blocks`: the blocks of one sequence of the model's full length. The default is the same on
    every device: engines that share one GPU (`kvpath up --engines N`, the test suites' workers) start at
    once, and a share of the memory each sees free would hand the same bytes to several of them."""
    if kv_cache_bytes is None:
        kv_cache_bytes = context_buffer_bytes(context_blocks * full_block_bytes)
    num_blocks = kv_cache_bytes // full_block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_bytes={kv_cache_bytes} holds no block of {full_block_bytes} bytes",
            param="kv_cache_bytes",
        )
    return num_blocks


def compute_id(device: torch.device | str) -> str:
    """What a runner on `device` computes on, named so that engines sharing it see the same name: one GPU by
    its uuid (the same under any CUDA_VISIBLE_DEVICES order), else the host's CPU cores."""
    device = torch.device(device)
    if device.type == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return f"cuda:{uuid}"
    return f"{device.type}@{socket.gethostname()}"
