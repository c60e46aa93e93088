"""What one token costs on the route wire and in the cache, from the served model (both ends agree on it)."""

from __future__ import annotations

from typing import Any

from services.policy.movequery import ModelShape
from shared.protocol import RouteCapability

PARTIAL_BYTES = 4  # (o, m, l) travel as fp32


def query_dim(spec: Any) -> int:
    """Values per query row: absorbed MLA kv_lora_rank + rope dim (= kv_dim), GQA head_dim."""
    return int(spec.kv_dim if spec.attention == "mla" else spec.head_dim)


def value_dim(spec: Any) -> int:
    return int(spec.kv_lora_rank if spec.attention == "mla" else spec.head_dim)


def model_shape(runner: Any) -> ModelShape:
    """The cost model's view of the served model: one row per (token, head)."""
    spec, itemsize = runner.spec, int(runner.kv.tensor.element_size())
    return ModelShape(
        num_layers=int(spec.num_layers),
        rows_per_token=int(spec.num_heads),
        query_bytes_per_row=query_dim(spec) * itemsize,
        partial_bytes_per_row=(value_dim(spec) + 2) * PARTIAL_BYTES,
        kv_bytes_per_token_layer=int(runner.kv.bytes_per_token_layer),
    )


def query_bytes_per_token(runner: Any) -> int:
    shape = model_shape(runner)
    return shape.rows_per_token * shape.query_bytes_per_row


def partial_bytes_per_token(runner: Any) -> int:
    shape = model_shape(runner)
    return shape.rows_per_token * shape.partial_bytes_per_row


def route_capability(runner: Any, **holder: Any) -> RouteCapability:
    """The shape in the load report, so the router prices routes without the model; `holder`: a holder's
    queue and counts (`RouteCapability`'s holder fields)."""
    shape = model_shape(runner)
    return RouteCapability(
        num_layers=shape.num_layers,
        rows_per_token=shape.rows_per_token,
        query_bytes_per_row=shape.query_bytes_per_row,
        partial_bytes_per_row=shape.partial_bytes_per_row,
        kv_bytes_per_token_layer=shape.kv_bytes_per_token_layer,
        **holder,
    )
