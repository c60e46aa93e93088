"""`kvpath profile`: AMPD's offline profiler (brief §2.1, §5.2) on the running machine.

Measures, with the model runtime in this process (the same code the engines run):
  T_pre(l_hist, l_incr)   an incremental prefill of `l_incr` tokens over `l_hist` cached ones, on a grid;
  T_dec(batch, context)   one decode step of `batch` sequences of a given context;
  T_kv(tokens, link)      moving a prompt's KV: `shm` (export from the paged cache into host memory and
                          import into a cache: what a same-host transfer does at least) and `storage`
                          (the block bytes written to a file and read back, as the storage service does).
and fits the piecewise alpha-beta models of `services/policy/ampd_costs.py` by least squares, segment by
segment. The file it writes (`CostModel.to_dict`) is what `--cost-profile` of the router and the engines
read. Prefill and decode engines run the same runtime on one machine, so both kinds get the same fit; on a
cluster, run it once per kind of machine and merge.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.policy.ampd_costs import (
    ROLE_DECODE,
    ROLE_PREFILL,
    STORAGE,
    CostModel,
    Link,
    Piecewise,
    decode_features,
    prefill_features,
)

HIST_GRID = (0, 256, 1024)
INCR_GRID = (16, 64, 256, 1024)
INCR_SEGMENTS = (0.0, 128.0)  # short increments pay the fixed costs; long ones are compute-bound
BATCH_GRID = (1, 2, 4, 8)
CONTEXT_GRID = (128, 512)
BATCH_SEGMENTS = (0.0, 4.0)
KV_TOKENS_GRID = (64, 256, 1024, 2048)
Points = tuple[list[float], list[tuple[float, ...]], list[float]]  # segment variable, features, seconds


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure T_pre, T_dec and T_kv here and fit AMPD's cost model")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is kept)")
    p.add_argument("--max-tokens", type=int, default=2048, help="leave out grid points longer than this")
    p.add_argument("--link", default="shm", help="name of the engine-to-engine link in the file")
    p.add_argument(
        "--num-threads", type=int, default=0, help="torch CPU threads, as the engines have (0: torch default)"
    )
    p.add_argument("--out", default="kvpath-profile.json", help="the profile file")
    p.set_defaults(func=_main)


# ------------------------------------------------------------------------------------------------ fitting


def fit_piecewise(
    segment_x: Sequence[float],
    features: Sequence[Sequence[float]],
    seconds: Sequence[float],
    starts: Sequence[float],
) -> Piecewise:
    """Least squares per segment of `segment_x` (a segment with too few points takes the fit of all), the
    coefficients clipped at 0 so that no segment predicts time going down as work goes up."""
    x, feats, ys = np.asarray(segment_x, float), np.asarray(features, float), np.asarray(seconds, float)
    whole = _lstsq(feats, ys)
    bounds = [*starts[1:], np.inf]
    rows = []
    for lo, hi in zip(starts, bounds, strict=True):
        mask = (x >= lo) & (x < hi)
        rows.append(_lstsq(feats[mask], ys[mask]) if mask.sum() >= feats.shape[1] else whole)
    return Piecewise(tuple(float(s) for s in starts), tuple(tuple(r) for r in rows))


def _lstsq(feats: np.ndarray, ys: np.ndarray) -> list[float]:
    coefs, *_ = np.linalg.lstsq(feats, ys, rcond=None)
    return [max(0.0, float(c)) for c in coefs]


def fit_link(num_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """alpha + bytes / bandwidth by least squares (the bandwidth from the largest move when the slope is not
    positive)."""
    b, s = np.asarray(num_bytes, float), np.asarray(seconds, float)
    slope, alpha = np.polyfit(b, s, 1)
    if slope <= 0:
        slope = s[-1] / b[-1]
    return Link(max(0.0, float(alpha)), float(1.0 / slope))


# ---------------------------------------------------------------------------------------------- measuring


def _median_s(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


class Profiler:
    def __init__(self, runner: Any, repeats: int, max_tokens: int) -> None:
        self.runner = runner
        self.repeats = repeats
        self.max_tokens = max_tokens
        self.block_size = runner.block_size
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def _blocks(self, tokens: int) -> list[int]:
        return list(range(-(-tokens // self.block_size)))

    def _prefill(self, blocks: list[int], cached: int, n: int) -> None:
        from gpu.runner import PrefillSeq

        seq = PrefillSeq("p", blocks, cached, [3 + i % 200 for i in range(n)])  # ids every vocabulary has
        self.loop.run_until_complete(self.runner.prefill([seq]))

    def prefill(self) -> Points:
        xs: list[float] = []
        feats: list[tuple[float, ...]] = []
        ys: list[float] = []
        for hist in HIST_GRID:
            for incr in INCR_GRID:
                if hist + incr > self.max_tokens:
                    continue
                blocks = self._blocks(hist + incr)
                if hist:
                    self._prefill(blocks, 0, hist)  # the history's KV, untimed
                self._prefill(blocks, hist, incr)  # warm-up of this shape
                ys.append(_median_s(functools.partial(self._prefill, blocks, hist, incr), self.repeats))
                xs.append(float(incr))
                feats.append(prefill_features(hist, incr))
        return xs, feats, ys

    def decode(self) -> Points:
        from gpu.runner import DecodeSeq

        xs: list[float] = []
        feats: list[tuple[float, ...]] = []
        ys: list[float] = []
        for context in CONTEXT_GRID:
            per_seq = -(-(context + 1) // self.block_size)
            for batch in BATCH_GRID:
                if per_seq * batch > self.runner.kv.num_blocks:
                    continue
                seqs = [
                    DecodeSeq(f"d{i}", list(range(i * per_seq, (i + 1) * per_seq)), context, 5)
                    for i in range(batch)
                ]
                step = functools.partial(self._decode, seqs)
                step()
                ys.append(_median_s(step, self.repeats))
                xs.append(float(batch))
                feats.append(decode_features(batch, batch * context))
        return xs, feats, ys

    def _decode(self, seqs: list[Any]) -> None:
        self.loop.run_until_complete(self.runner.decode(seqs))

    def links(self) -> dict[str, tuple[list[float], list[float]]]:
        kv = self.runner.kv
        shm: tuple[list[float], list[float]] = ([], [])
        storage: tuple[list[float], list[float]] = ([], [])
        with tempfile.TemporaryDirectory() as tmp:
            for tokens in KV_TOKENS_GRID:
                blocks = self._blocks(tokens)
                if len(blocks) > kv.num_blocks:
                    continue
                nbytes = len(blocks) * kv.full_block_bytes
                buf = np.empty(nbytes, dtype=np.uint8).reshape(
                    len(blocks), kv.num_layers, kv.block_size, kv.bytes_per_token_layer
                )

                def move(b: list[int] = blocks, out: np.ndarray = buf) -> None:
                    kv.export_blocks(b, out)
                    kv.import_blocks(b, out)

                path = Path(tmp) / "blocks"

                def store(b: list[int] = blocks, out: np.ndarray = buf, p: Path = path) -> None:
                    kv.export_blocks(b, out)
                    p.write_bytes(out.reshape(-1).data)
                    with open(p, "rb") as f:
                        f.readinto(memoryview(out.reshape(-1).data))
                    os.remove(p)

                for (sizes, times), run in ((shm, move), (storage, store)):
                    run()
                    sizes.append(float(nbytes))
                    times.append(_median_s(run, self.repeats))
        return {"shm": shm, STORAGE: storage}


def profile(runner: Any, *, repeats: int, max_tokens: int, link: str) -> CostModel:
    """Measure and fit (the cost model of this machine for `runner`'s model)."""
    prof = Profiler(runner, repeats, max_tokens)
    try:
        pre = fit_piecewise(*prof.prefill(), INCR_SEGMENTS)
        dec = fit_piecewise(*prof.decode(), BATCH_SEGMENTS)
        links = {(link if name == "shm" else name): fit_link(*m) for name, m in prof.links().items()}
    finally:
        prof.close()
    return CostModel(
        kv_bytes_per_token=int(runner.kv_bytes_per_token),
        prefill={ROLE_PREFILL: pre, ROLE_DECODE: pre},
        decode={ROLE_PREFILL: dec, ROLE_DECODE: dec},
        links=links,
        meta={"source": "kvpath profile", "time": time.time()},
    )


def _main(args: argparse.Namespace) -> int:
    from gpu.runner import ModelRunner

    blocks = -(-max(args.max_tokens, max(CONTEXT_GRID) * max(BATCH_GRID) + 64 * max(BATCH_GRID)) // 64) + 8
    threads = args.num_threads or None
    runner = ModelRunner.load(args.model, device=args.device, num_kv_blocks=blocks, num_threads=threads)
    try:
        model = profile(runner, repeats=args.repeats, max_tokens=args.max_tokens, link=args.link)
        model = CostModel(**{**_fields(model), "meta": {**model.meta, "model": args.model}})
    finally:
        runner.close()
    Path(args.out).write_text(json.dumps(model.to_dict(), indent=2))
    _print(model)
    print(f"wrote {args.out}")
    return 0


def _fields(model: CostModel) -> dict[str, Any]:
    return {f: getattr(model, f) for f in ("kv_bytes_per_token", "prefill", "decode", "links", "meta")}


def _print(model: CostModel) -> None:
    print(f"{'T_pre(l_hist, l_incr)':>24}  {'l_incr=64':>10} {'256':>10} {'1024':>10}")
    for hist in HIST_GRID:
        row = " ".join(f"{model.prefill_s(hist, n) * 1e3:8.2f}ms" for n in (64, 256, 1024))
        print(f"{'l_hist=' + str(hist):>24}  {row}")
    for batch in BATCH_GRID:
        step_ms = model.decode_step_s(batch, batch * 512) * 1e3
        print(f"{'T_dec(batch=' + str(batch) + ', ctx 512)':>24}  {step_ms:9.2f}ms")
    for name, link in model.links.items():
        print(f"{'T_kv ' + name:>24}  alpha {link.alpha_s * 1e6:.1f} us, {link.bytes_per_s / 1e9:.2f} GB/s")
