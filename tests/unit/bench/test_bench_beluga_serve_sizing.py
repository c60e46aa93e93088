"""`kvpath bench beluga`'s serving workload for a real model: prompts drawn from the model's ordinary tokens
(never its control tokens), and both clusters sized from the documents' KV (the pool and the remote store
alike, the baseline's local DRAM cache a fraction of it), caller flags last."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from loadgen.bench import beluga
from loadgen.bench.beluga_serve import POOL_SHARE, REMOTE_CACHE_SHARE, ServeOptions, _documents, token_ids


def test_smollm2_prompts_hold_no_control_token() -> None:
    from gpu.model_spec import load_model_spec
    from gpu.tokenizer import load_tokenizer

    spec = load_model_spec("smollm2")
    ids = token_ids("smollm2")
    assert ids.min() >= 0 and ids.max() < spec.vocab_size
    added = json.loads(load_tokenizer(spec.model_dir).backend_json())["added_tokens"]
    control = {t["id"] for t in added if t["special"]}
    assert control == set(range(17))  # SmolLM2's: <|endoftext|>, <|im_start|>, <|im_end|>, ... <empty_output>
    assert set(spec.eos_token_ids) <= control and not control & set(ids.tolist())
    docs = _documents(ServeOptions(docs=2, doc_tokens=500))
    assert all(len(d) == 500 and not control & set(d) for d in docs)
    assert len(set(docs[0])) > 400  # the whole vocabulary, not a corner of it


def test_embedded_models_keep_their_printable_bytes() -> None:
    assert token_ids("tiny").tolist() == list(range(3, 250))


def test_clusters_are_sized_from_the_working_set() -> None:
    opts = ServeOptions(docs=4, doc_tokens=1000, up_args=["--pool-bytes", "123"])
    working_set = 4 * 1000 * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V of 3 x 64 fp32
    assert opts.working_set_bytes() == working_set
    pool, remote = opts.cluster_args("pool"), opts.cluster_args("remote")
    assert pool[: pool.index("--pool-bytes") + 2][-1] == str(int(POOL_SHARE * working_set))
    assert pool[-2:] == ["--pool-bytes", "123"]  # the caller's flags come last: they win
    assert f"--engine-arg=--kv-cache-bytes {opts.kv_cache_bytes}" in pool
    assert not any("remote-cache-bytes" in a for a in pool)
    assert f"--engine-arg=--remote-cache-bytes {int(REMOTE_CACHE_SHARE * working_set)}" in remote
    assert remote[remote.index("--pool-bytes") + 1] == pool[pool.index("--pool-bytes") + 1]  # same capacity
    fixed = ServeOptions(model="tiny", pool_bytes=1 << 30, remote_cache_bytes=1 << 20, kv_cache_bytes=0)
    args = fixed.cluster_args("remote")
    assert args[:2] == ["--model", "tiny"] and str(1 << 30) in args
    assert "--engine-arg=--remote-cache-bytes 1048576" in args
    assert not any("kv-cache-bytes" in a for a in args)


def test_cli_passes_the_model_and_sizes() -> None:
    parser = argparse.ArgumentParser()
    beluga.register(parser.add_subparsers())
    args = parser.parse_args(["beluga", "--model", "tiny", "--pool-bytes", "7", "--kv-cache-bytes", "9"])
    assert (args.model, args.pool_bytes, args.kv_cache_bytes) == ("tiny", 7, 9)
    assert parser.parse_args(["beluga"]).model == "smollm2"


@pytest.mark.parametrize("bad", [{"pool_bytes": -1}, {"remote_cache_bytes": -1}, {"kv_cache_bytes": -1}])
def test_negative_sizes_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ServeOptions(**bad).validate()


def test_documents_are_the_same_for_both_tiers() -> None:
    a, b = _documents(ServeOptions(docs=3, doc_tokens=64)), _documents(ServeOptions(docs=3, doc_tokens=64))
    assert a == b and isinstance(a[0][0], int) and not isinstance(a[0][0], np.integer)
