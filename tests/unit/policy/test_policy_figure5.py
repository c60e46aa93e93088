"""A Figure-5-style walk-through: one PE group of 8 GPUs on 4 prefill nodes, a decode node, a short FIFO.

alpha = 300 tokens, beta = 1000 tokens. Reported read queues: node 0 = 100 and node 2 = 250 are short
(category 2 candidates), node 1 = 900 and node 3 = 2000 are long (category 3); the decode node 4 has 500.
GPUs g0 (1200 tokens) and g7 (1001) start overloaded (category 1).
"""

from __future__ import annotations

from services.policy.snapshot import ROLE_PREFILL, ClusterSnapshot, EngineSnapshot, ReadSide
from tests.reference_placement import place_dualpath, select_prefill_engines
from tests.unit.policy.snapshots import de, limits, node, req, snap

PE_TOKENS = {"g0": 1200, "g1": 800, "g2": 100, "g3": 50, "g4": 600, "g5": 950, "g6": 0, "g7": 1001}
PE_NODE = {"g0": 0, "g1": 0, "g2": 1, "g3": 1, "g4": 2, "g5": 2, "g6": 3, "g7": 3}

# request, len_r, chosen PE, why; read side and node (hit = len_r - 20), read queues after the decision
STEPS = [
    ("r1", 300, "g4", "cat 2 {g1 800, g4 600, g5 950}", ReadSide.PE, 2),  # n2 250 <= n4 500 -> n2 530
    ("r2", 300, "g1", "cat 2 {g1 800, g4 900, g5 950}", ReadSide.PE, 0),  # n0 100 <= 500 -> n0 380
    ("r3", 200, "g4", "cat 2 {g4 900, g5 950}; g1 now 1100", ReadSide.DE, 4),  # n2 530 > n4 500 -> n4 680
    ("r4", 400, "g5", "cat 2 {g5 950}; g4 now 1100", ReadSide.PE, 2),  # n2 530 <= 680 -> n2 910
    ("r5", 100, "g6", "cat 2 empty -> cat 3 {g2 100, g3 50, g6 0}", ReadSide.DE, 4),  # n3 2000 > 680 -> 760
    ("r6", 100, "g3", "cat 3 {g2 100, g3 50, g6 100}", ReadSide.DE, 4),  # n1 900 > 760 -> n4 840
    ("r7", 100, "g2", "cat 3 tie g2/g6 at 100: g2 has fewer requests", ReadSide.DE, 4),  # 900 > 840 -> 920
    ("r8", 1000, "g6", "cat 3 {g2 200, g3 150, g6 100}", ReadSide.DE, 4),  # n3 2000 > 920 -> n4 1900
    ("r9", 1000, "g3", "cat 3 {g2 200, g3 150}; g6 now 1100", ReadSide.PE, 1),  # n1 900 <= 1900 -> 1880
    ("r10", 1000, "g2", "cat 3 {g2 200}; g3 now 1150", ReadSide.PE, 1),  # n1 1880 <= 1900 -> 2860
]


def figure5_snapshot() -> ClusterSnapshot:
    pes = [
        EngineSnapshot(gpu, ROLE_PREFILL, PE_NODE[gpu], "pe-group", 0, tokens)
        for gpu, tokens in PE_TOKENS.items()
    ]
    nodes = [node(0, 100), node(1, 900), node(2, 250), node(3, 2000), node(4, 500)]
    queue = [req(name, length, hit=length - 20) for name, length, *_ in STEPS]
    queue.append(req("r11", 10, hit=0))  # every PE is over beta by now: r11 waits for the next fetch
    return snap([*pes, de("d", 4, 0)], nodes, queue)


def test_pe_choices_step_by_step() -> None:
    chosen = select_prefill_engines(figure5_snapshot(), limits(alpha=300, beta=1000))
    for step, (name, _, expected, why, _, _) in enumerate(STEPS):
        assert chosen[step] == expected, f"{name}: {why}"
    assert len(chosen) == len(STEPS)  # the fetch ends before r11
    assert not {"g0", "g7"} & set(chosen)  # category 1 never gets a request


def test_full_scheduler_read_sides_step_by_step() -> None:
    placements = place_dualpath(figure5_snapshot(), limits(alpha=300, beta=1000))
    assert [p.request_id for p in placements] == [s[0] for s in STEPS]
    for p, (name, length, pe_id, _, side, read_node) in zip(placements, STEPS, strict=True):
        assert (p.pe_id, p.de_id, p.read_side, p.read_node, p.read_tokens) == (
            pe_id,
            "d",
            side,
            read_node,
            length - 20,
        ), name
