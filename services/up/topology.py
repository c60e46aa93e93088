"""What `kvpath up` starts: a pure description of the local cluster's processes (`ClusterSpec`, from the
command line's flags by `spec_from_args`; `cluster_processes`).

Nodes are emulated on one host: each has its own storage service (own DRAM buffer and bandwidth budget)
and its engines; all nodes share one store root, as nodes share a distributed file system.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.policy.ampd import AMPD, SESSION_COLOCATED, SESSION_POLICIES
from services.policy.auto import AUTO
from services.policy.colocated import BELUGA, CACHE_AWARE, COLOCATED, COLOCATED_POLICIES
from services.policy.table_placement import POLICIES

# `--policy auto` on P/D nodes: what the decode engines are (services/router/auto_pd.PD_PATHS, kept equal by a
# test; importing the router here would slow `kvpath --help`)
SESSION_DECODE = "session"
AUTO_DECODE_ENGINES = (SESSION_DECODE, "dualpath")
PREFILL_ORDERS = ("fcfs", "short-first", "slo")  # the engines' (services/engine/config.py)
# what the engines of every policy but the session ones (AMPD and its paper baselines) run unless told: an
# agent's warm turn passes cold prompts, and a step lasts about a second whatever the hardware (README,
# "Agents' warm turns"); `--prefill-order fcfs --step-target-s 0` is the plain FCFS engine
AGENT_PREFILL_ORDER = "short-first"
AGENT_STEP_TARGET_S = 1.0


@dataclass(slots=True)
class ClusterSpec:
    model: str = "tiny"
    policy: str = "colocated"
    colocated_engines: int = 1
    prefill_nodes: int = 0
    decode_nodes: int = 0
    engines_per_node: int = 1
    host: str = "127.0.0.1"
    http_port: int = 8000
    kv_root: str = ""
    storage_bandwidth_bytes_per_s: int = 0
    with_kv_store: bool = True
    kv_tier: str = (
        "storage"  # storage | pool (Beluga's shared KV pool) | remote (remote-memory pool baseline)
    )
    pool_bytes: int = 0  # pool / remote store capacity (0: the service's default)
    block_size: int = 64
    auto_decode_engines: str = SESSION_DECODE  # auto on P/D nodes: session, or DualPath's (decode only)
    prefill_order: str = ""  # every prefill queue's order ('': the policy's default)
    step_target_s: float = -1.0  # the engines' step target (< 0: the policy's default)
    cores: int = 0  # the host's cores, split among the engines' torch threads (0: torch's default each)
    extra_engine_args: list[str] = field(default_factory=list)
    extra_router_args: list[str] = field(default_factory=list)

    @property
    def is_disaggregated(self) -> bool:
        return self.prefill_nodes > 0 or self.decode_nodes > 0


@dataclass(slots=True)
class ProcessSpec:
    name: str  # unique, also the service id
    service: str  # router | engine | storage | index
    args: list[str]
    kind: str  # service kind in the registry
    role: str = ""


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """`kvpath up`'s flags of the policy, what `--policy auto`'s decode engines are, the KV tier (which
    picks a default policy) and the prefill order."""
    p.add_argument(
        "--policy",
        default="",
        help="colocated | beluga | cache-aware | dualpath | basic | dualpath-rr (disaggregated: default "
        "dualpath) | ampd | disagg-remote (disaggregated, session engines) | session-colocated | auto "
        "(one cost model over the KV paths the engines offer: colocated, or P/D: see --auto-decode-engines)",
    )
    p.add_argument(
        "--auto-decode-engines",
        choices=AUTO_DECODE_ENGINES,
        default=SESSION_DECODE,
        help="--policy auto on prefill/decode nodes: the decode engines. session: they keep sessions and may "
        "prefill a turn themselves (local/*, remote/hbm); dualpath: DualPath's, decode only, and a PE's "
        "stored prefix may be read on the decode node and streamed over (remote/storage-de)",
    )
    p.add_argument(
        "--kv-tier",
        choices=("storage", "pool", "remote"),
        default="storage",
        help="KV tier above storage: none, Beluga's shared pool (default policy beluga; on prefill/decode "
        "nodes with --policy auto), or the remote-memory pool baseline (default policy cache-aware)",
    )
    p.add_argument(
        "--prefill-order",
        choices=PREFILL_ORDERS,
        default="",
        help="every prefill queue's order: the engines' and, under dualpath | basic | dualpath-rr, the "
        "router's placement queue (default short-first; ampd's engines: slo; disagg-remote and "
        "colocated-session: fcfs)",
    )
    p.add_argument(
        "--step-target-s",
        type=float,
        default=-1.0,
        help="each engine step's prefill budget is what the measured compute rate runs in this long (0: "
        f"the fixed max_num_batched_tokens; default {AGENT_STEP_TARGET_S}, 0 under the session policies)",
    )


def spec_from_args(args: argparse.Namespace, kv_root: str) -> ClusterSpec:
    """The cluster `kvpath up`'s flags describe, its block store at `kv_root`; flags that do not fit the
    topology exit, saying why."""
    disaggregated = args.prefill_nodes > 0 or args.decode_nodes > 0
    if disaggregated and (args.prefill_nodes < 1 or args.decode_nodes < 1):
        raise SystemExit("kvpath up: disaggregated mode needs --prefill-nodes >= 1 and --decode-nodes >= 1")
    default = {"pool": BELUGA, "remote": CACHE_AWARE}.get(args.kv_tier, COLOCATED)
    policy = args.policy or ("dualpath" if disaggregated else default)
    if policy != AUTO and disaggregated == (policy in (*COLOCATED_POLICIES, SESSION_COLOCATED)):
        raise SystemExit(f"kvpath up: policy {policy!r} does not fit the topology")
    if args.auto_decode_engines != SESSION_DECODE and not (policy == AUTO and disaggregated):
        raise SystemExit("kvpath up: --auto-decode-engines is for --policy auto on prefill/decode nodes")
    if args.step_target_s != -1.0 and not 0 <= args.step_target_s <= 3600:
        raise SystemExit(f"kvpath up: --step-target-s must be between 0 and 3600, got {args.step_target_s}")
    if args.kv_tier != "storage" and args.no_kv_store:
        raise SystemExit("kvpath up: --kv-tier pool|remote serves engines with a KV store")
    if disaggregated and args.kv_tier == "remote":
        raise SystemExit("kvpath up: --kv-tier remote serves colocated engines only")
    if disaggregated and args.kv_tier == "pool" and policy != AUTO:
        raise SystemExit(
            f"kvpath up: --kv-tier pool on prefill/decode nodes needs --policy auto ({policy!r} never "
            "plans a pool read)"
        )
    return ClusterSpec(
        model=args.model,
        policy=policy,
        colocated_engines=args.engines,
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
        engines_per_node=args.engines_per_node,
        host=args.host,
        http_port=args.http_port,
        kv_root=kv_root,
        storage_bandwidth_bytes_per_s=int(args.storage_bandwidth),
        with_kv_store=not args.no_kv_store,
        kv_tier=args.kv_tier,
        pool_bytes=args.pool_bytes,
        block_size=args.block_size,
        auto_decode_engines=args.auto_decode_engines,
        prefill_order=args.prefill_order,
        step_target_s=args.step_target_s,
        cores=0 if "KVPATH_NUM_THREADS" in os.environ else host_cores(),
        extra_engine_args=_split(args.engine_arg),
        extra_router_args=_split(args.router_arg),
    )


def host_cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(num_engines: int, cores: int) -> int:
    """torch threads per engine when `num_engines` share `cores`, as engines pinned to disjoint cores would
    have (at least 1). torch's default, a thread per core in every engine, oversubscribes the host: on two
    cores, three engines' spinning workers slowed the busiest configuration by 10-40% (README, "Move the
    query", fan-in)."""
    return max(1, cores // max(1, num_engines))


def _split(flags: list[str]) -> list[str]:
    return [part for flag in flags for part in flag.split()]


def cluster_processes(spec: ClusterSpec) -> list[ProcessSpec]:
    """Every process of the cluster, in start order (index and storage before engines, router last)."""
    procs: list[ProcessSpec] = []
    common = ["--block-size", str(spec.block_size)]
    if spec.with_kv_store:
        # snapshots beside the block store: restarts replay less, and purging keeps the stream (and
        # nats-server's memory) short
        index_args = ["--data-dir", f"{spec.kv_root.rstrip('/')}.index"] if spec.kv_root else []
        procs.append(ProcessSpec("index-0", "index", index_args, kind="index"))
    tier_args = _tier_processes(spec, procs, common)
    nodes = _nodes(spec)
    if spec.with_kv_store:
        context_bytes = _context_kv_bytes(spec)
        for node in sorted({n for n, _ in nodes}):
            args = [
                "--node",
                str(node),
                "--root",
                spec.kv_root,
                "--bandwidth-bytes-per-s",
                str(spec.storage_bandwidth_bytes_per_s),
            ]
            args += _storage_buffer_args(context_bytes, sum(1 for n, _ in nodes if n == node))
            procs.append(ProcessSpec(f"storage-{node}", "storage", args, kind="storage"))
    threads = []  # the user's own --num-threads (an --engine-arg) wins
    if spec.cores > 0 and not any(a.split("=")[0] == "--num-threads" for a in spec.extra_engine_args):
        threads = ["--num-threads", str(engine_threads(len(nodes), spec.cores))]
    for i, (node, role) in enumerate(nodes):
        session_args = _session_args(spec, role)
        # the pool serves the engines that prefill: colocated, prefill and session decode engines
        uses_tier = role != "decode" or "--session-kv" in session_args
        args = ["--role", role, "--node", str(node), "--model", spec.model, *common, *threads]
        args += (tier_args if uses_tier else []) + session_args
        args += _scheduling_args(spec)  # after the policy's own order: the later flag wins
        if not spec.with_kv_store:
            args += ["--no-persist-kv", "--no-load-kv"]
        procs.append(
            ProcessSpec(
                f"{_short(role)}{i}-n{node}",
                "engine",
                args + spec.extra_engine_args,
                kind="engine",
                role=role,
            )
        )
    procs.append(
        ProcessSpec("router-0", "router", _router_args(spec) + spec.extra_router_args, kind="router")
    )
    return procs


def _router_args(spec: ClusterSpec) -> list[str]:
    """The router's flags; it takes the block size (and the whole KV format) from the engines' reports."""
    router_args = [
        "--model",
        spec.model,
        "--policy",
        spec.policy,
        "--http-host",
        spec.host,
        "--http-port",
        str(spec.http_port),
    ]
    if not spec.with_kv_store:
        router_args.append("--no-use-kv-cache")
    if spec.policy == AUTO and spec.is_disaggregated:
        router_args += ["--auto-decode-engines", spec.auto_decode_engines]
    if spec.policy in POLICIES and prefill_order(spec) == "short-first":  # DualPath's placement queue too
        router_args += ["--prefill-order", "short-first"]
    return router_args


def fcfs_engine_args(policy: str) -> list[str]:
    """`kvpath up` flags that keep the plain FCFS engines (fixed step budget) under `policy`: what the
    benchmarks whose tables were recorded before the agent defaults pass, to stay comparable."""
    return [] if policy in SESSION_POLICIES else ["--prefill-order", "fcfs", "--step-target-s", "0"]


def prefill_order(spec: ClusterSpec) -> str:
    """The engines' prefill order ('': the session policy's own)."""
    return spec.prefill_order or ("" if spec.policy in SESSION_POLICIES else AGENT_PREFILL_ORDER)


def step_target_s(spec: ClusterSpec) -> float:
    if spec.step_target_s >= 0:
        return spec.step_target_s
    return 0.0 if spec.policy in SESSION_POLICIES else AGENT_STEP_TARGET_S


def _scheduling_args(spec: ClusterSpec) -> list[str]:
    order, target = prefill_order(spec), step_target_s(spec)
    return (["--prefill-order", order] if order else []) + (
        ["--step-target-s", str(target)] if target else []
    )


def _tier_processes(spec: ClusterSpec, procs: list[ProcessSpec], common: list[str]) -> list[str]:
    """Start the KV tier's service (the pool, or the remote store) and return the engine flags that use it."""
    capacity = ["--capacity-bytes", str(spec.pool_bytes)] if spec.pool_bytes else []
    if spec.kv_tier == "pool":
        args = ["--model", spec.model, *common, *capacity, *_engine_dtype_args(spec.extra_engine_args)]
        procs.append(ProcessSpec("pool-0", "cxlpool", args, kind="cxlpool"))
        return ["--kv-pool", "pool-0"]
    if spec.kv_tier == "remote":
        # the store stands for a remote memory pool: reached over the network (rdma where there is a
        # device, else tcp), never through this host's shared memory
        args = [*capacity, "--kv-backends", "rdma,tcp"]
        procs.append(ProcessSpec("remotekv-0", "remotekv", args, kind="remotekv"))
        return ["--kv-remote", "remotekv-0"]
    return []


def _session_args(spec: ClusterSpec, role: str) -> list[str]:
    """Engine flags of the session policies (AMPD and its baselines) and of `auto` on P/D nodes: decode
    engines keep sessions (auto's `local` and `hbm` paths) unless auto runs DualPath's decode engines; under
    `ampd` every prefill queue is ordered by Algorithm 2."""
    policy = spec.policy
    if policy == AUTO:
        keeps_sessions = role == "decode" and spec.auto_decode_engines == SESSION_DECODE
        return ["--session-kv"] if keeps_sessions else []
    if policy not in SESSION_POLICIES:
        return []
    args = ["--session-kv"] if role == "decode" else []
    return args + (["--prefill-order", "slo"] if policy == AMPD else [])


def _nodes(spec: ClusterSpec) -> list[tuple[int, str]]:
    """(node, role) per engine: colocated engines on node 0, else prefill nodes first, then decode nodes.
    `session-colocated` engines are session engines (decode role) that prefill every turn themselves."""
    if not spec.is_disaggregated:
        role = "decode" if spec.policy == SESSION_COLOCATED else "colocated"
        return [(0, role)] * spec.colocated_engines
    out = []
    for p in range(spec.prefill_nodes):
        out += [(p, "prefill")] * spec.engines_per_node
    for d in range(spec.decode_nodes):
        out += [(spec.prefill_nodes + d, "decode")] * spec.engines_per_node
    return out


def _short(role: str) -> str:
    return {"colocated": "engine", "prefill": "pe", "decode": "de"}[role]


def _context_kv_bytes(spec: ClusterSpec) -> int:
    """KV bytes of one prompt of the model's full length, in the engines' dtype (fp32 where their flags do
    not fix it: the larger, and only what is used of a shared-memory buffer takes memory)."""
    from gpu.model_spec import load_model_spec

    dtype_args = _engine_dtype_args(spec.extra_engine_args)
    dtype = dtype_args[1] if dtype_args else "float32"
    model = load_model_spec(spec.model)
    return model.max_model_len * model.num_layers * model.kv_bytes_per_token_layer(dtype)


def _storage_buffer_args(context_bytes: int, num_engines: int) -> list[str]:
    """A node buffer (what stored prefixes are read into) with room for two full-length prompts per engine
    of the node, when that is more than the storage service's default: 256 MiB held 5,800 tokens of
    SmolLM2's fp32 KV, so a longer stored prefix was read in part and its tail recomputed."""
    from services.storage.config import StorageConfig
    from shared.blocks import context_buffer_bytes

    need = context_buffer_bytes(context_bytes) * num_engines
    return ["--buffer-bytes", str(need)] if need > StorageConfig().buffer_bytes else []


def _engine_dtype_args(engine_args: list[str]) -> list[str]:
    """The pool's `--dtype`: the engines' KV dtype where their flags fix it (`--dtype`, or `--device` whose
    default it is), else none, and the pool takes the engines' default on this host as they do."""
    from gpu.model_spec import default_dtype

    flags: dict[str, str] = {}
    for i, arg in enumerate(engine_args):
        name, eq, value = arg.partition("=")
        if name in ("--dtype", "--device"):
            flags[name] = value if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else "")
    if flags.get("--dtype"):
        return ["--dtype", flags["--dtype"]]
    device = flags.get("--device", "auto")
    return [] if device == "auto" else ["--dtype", default_dtype(device)]
