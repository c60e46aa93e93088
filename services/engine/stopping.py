"""When a sequence stops (pure)."""

from __future__ import annotations

from collections.abc import Collection

from services.engine.sequence import Sequence


def check_stop(
    seq: Sequence, token: int, eos_token_ids: Collection[int], max_model_len: int
) -> tuple[bool, str | None]:
    """For a newly sampled `token`: (whether it is emitted, the finish reason or None).

    EOS (unless ignore_eos) and stop token ids end the sequence and are not emitted; both are suppressed at
    sampling until min_tokens are out. max_tokens and the context limit end it after emitting the token.
    """
    params = seq.sampling
    if len(seq.output_token_ids) >= params.min_tokens:
        if token in eos_token_ids and not params.ignore_eos:
            return False, "stop"
        if token in params.stop_token_ids:
            return False, "stop"
    if len(seq.output_token_ids) + 1 >= params.max_tokens or seq.num_tokens + 1 >= max_model_len:
        return True, "length"
    return True, None
