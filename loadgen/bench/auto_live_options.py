"""The options of `kvpath bench auto --live`, apart from its runners (`auto_live.py` runs the configurations,
`auto_live_agents.py` holds the agent ones) so that both import them."""

from __future__ import annotations

from dataclasses import dataclass

CONFIG_NAMES = ("pool", "remote", "pd", "fanin")  # auto_live.CONFIGS: each one's policies


@dataclass(frozen=True, slots=True)
class LiveOptions:
    engines: int = 2
    docs: int = 6
    doc_tokens: int = 1500
    questions: int = 48
    sessions: int = 4
    clients: int = 4
    max_tokens: int = 8
    repeats: int = 2  # runs per policy
    configs: tuple[str, ...] = CONFIG_NAMES
    seed: int = 0
    # pd: multi-turn agents on 1 prefill + 1 decode node
    pd_sessions: int = 6
    pd_clients: int = 3
    pd_turns: tuple[int, int] = (4, 6)  # turns per session, drawn uniformly
    pd_first_tokens: int = 1500
    pd_tool_tokens: tuple[int, int] = (100, 300)  # a tool result per later turn
    pd_output_tokens: int = 16
    pd_tool_latency_s: float = 0.1
    # fanin: one pinned document, sub-agents on colocated engines that move the query
    fanin_engines: int = 3
    fanin_agents: int = 12
    fanin_clients: int = 0  # 0: every sub-agent at once
    fanin_doc_tokens: int = 1500
    fanin_suffix_tokens: tuple[int, int] = (64, 256)
    fanin_answer_tokens: int = 16
