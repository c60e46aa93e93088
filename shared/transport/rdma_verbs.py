"""Thin layer over pyverbs: load it, open a device, RC queue pairs, memory registration, CQ polling.

pyverbs is Debian's python3-pyverbs: it lives in the system Python's dist-packages, not in the venv, so
`load_pyverbs` imports it from there when a plain import fails (same CPython minor version, same ABI).
Nothing here is imported unless the rdma backend is allowed and asked for. Written against the pyverbs
API of rdma-core 44; it was not run against a device on the machine it was written on (none there).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from shared.errors import TransportError
from shared.protocol.transfer import RdmaQpInfo
from shared.transport.config import TransportConfig

_SYSTEM_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_MAX_PIECE_BYTES = 1 << 30  # below the 2 GiB RDMA message limit of common HCAs
_BUSY_POLLS = 200  # event-loop yields before polling backs off to sleeps


@dataclass(slots=True)
class Verbs:
    """The pyverbs modules this layer uses."""

    device: Any
    pd: Any
    mr: Any
    cq: Any
    qp: Any
    wr: Any
    addr: Any
    enums: Any


def load_pyverbs() -> Verbs:
    """Import pyverbs from the venv or the system dist-packages; ImportError says why not."""
    try:
        importlib.import_module("pyverbs")
    except ImportError:
        _import_from_system()
    names = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums")
    modules = [importlib.import_module(f"pyverbs.{name}") for name in names]
    return Verbs(*modules)


def _import_from_system() -> ModuleType:
    for base in _SYSTEM_DIRS:
        init = Path(base) / "pyverbs" / "__init__.py"
        if not init.exists():
            continue
        spec = importlib.util.spec_from_file_location(
            "pyverbs", init, submodule_search_locations=[str(init.parent)]
        )
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["pyverbs"]
            raise
        return module
    raise ImportError(f"pyverbs is not installed (python3-pyverbs; looked in the venv and {_SYSTEM_DIRS})")


def buffer_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class RdmaDevice:
    """An open device port with its protection domain; one per process side (receiver or sender)."""

    def __init__(self, verbs: Verbs, config: TransportConfig) -> None:
        self.verbs = verbs
        names = [d.name.decode() for d in verbs.device.get_device_list()]
        self.name = config.rdma_device or (names[0] if names else "")
        if self.name not in names:
            raise TransportError(f"RDMA device {self.name!r} not found (devices: {names})")
        self.port = config.rdma_port
        self.queue_depth = config.rdma_queue_depth
        self.ctx = verbs.device.Context(name=self.name)
        try:
            port_attr = self.ctx.query_port(self.port)
            if port_attr.state != verbs.enums.IBV_PORT_ACTIVE:
                raise TransportError(f"RDMA device {self.name} port {self.port} is not active")
            self.lid = int(port_attr.lid)
            self.mtu = int(port_attr.active_mtu)
            is_roce = port_attr.link_layer == verbs.enums.IBV_LINK_LAYER_ETHERNET
            self.gid_index = config.rdma_gid_index
            if self.gid_index < 0:
                self.gid_index = self._pick_gid(int(port_attr.gid_tbl_len), is_roce)
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index).gid)
            self.pd = verbs.pd.PD(self.ctx)
        except BaseException:
            self.ctx.close()
            raise

    def _pick_gid(self, table_len: int, is_roce: bool) -> int:
        """IB: index 0. RoCE: a RoCE v2 IPv4-mapped GID if any, else the first non-zero one."""
        if not is_roce:
            return 0
        fallback = -1
        for index in range(table_len):
            try:
                gid = str(self.ctx.query_gid(self.port, index).gid)
                kind = self.ctx.query_gid_type(self.port, index)
            except Exception:
                continue
            if gid == _ZERO_GID:
                continue
            if kind == self.verbs.enums.IBV_GID_TYPE_SYSFS_ROCE_V2 and gid.startswith(
                "0000:0000:0000:0000:0000:ffff"
            ):
                return index
            fallback = index if fallback < 0 else fallback
        if fallback < 0:
            raise TransportError(f"RDMA device {self.name} port {self.port} has no usable GID")
        return fallback

    def register(self, address: int, length: int, *, remote_write: bool) -> Any:
        """Register memory the caller owns (pyverbs will not free it)."""
        e = self.verbs.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0
        return self.verbs.mr.MR(self.pd, length, access, address=address)

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class RcQueuePair:
    """One reliable-connected queue pair with its own completion queue and a small scratch MR."""

    def __init__(self, device: RdmaDevice) -> None:
        v, e = device.verbs, device.verbs.enums
        self.device = device
        self.depth = device.queue_depth
        self.cq = v.cq.CQ(device.ctx, self.depth * 2, None, None, 0)
        cap = v.qp.QPCap(max_send_wr=self.depth, max_recv_wr=self.depth, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        attr = v.qp.QPAttr(port_num=device.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp = v.qp.QP(device.pd, init, attr)  # left in INIT
        self.psn = random.getrandbits(24)
        self.scratch = v.mr.MR(device.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
        self.done_wr_ids: set[int] = set()
        self.immediates: set[int] = set()

    def local_info(self) -> RdmaQpInfo:
        d = self.device
        return RdmaQpInfo(qp_num=int(self.qp.qp_num), psn=self.psn, lid=d.lid, gid=d.gid, mtu=d.mtu)

    def connect(self, remote: RdmaQpInfo) -> None:
        """INIT -> RTR -> RTS against the remote side's queue pair."""
        v, e, d = self.device.verbs, self.device.verbs.enums, self.device
        attr = v.qp.QPAttr(port_num=d.port)
        attr.path_mtu = min(d.mtu, remote.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        if remote.gid != _ZERO_GID:
            dgid = v.addr.GID()
            dgid.gid = remote.gid
            route = v.addr.GlobalRoute(dgid=dgid, sgid_index=d.gid_index)
            attr.ah_attr = v.addr.AHAttr(port_num=d.port, is_global=1, gr=route, dlid=remote.lid)
        else:
            attr.ah_attr = v.addr.AHAttr(port_num=d.port, is_global=0, dlid=remote.lid)
        self.qp.to_rts(attr)

    def post_receives(self, count: int) -> None:
        """Receive slots consumed by incoming writes-with-immediate (their payload needs no buffer)."""
        v = self.device.verbs
        for _ in range(count):
            sge = v.wr.SGE(self.scratch.buf, self.scratch.length, self.scratch.lkey)
            wr = v.wr.RecvWR(wr_id=0, num_sge=1, sg=[sge])
            self.qp.post_recv(wr)
            wr.close()

    def post_writes(
        self, pieces: list[tuple[int, int, int, int, int]], *, imm: int | None, wr_id: int
    ) -> None:
        """Post RDMA WRITEs (local addr, length, lkey, remote addr, rkey) as one chain; only the last is
        signaled (completion `wr_id`) and, with `imm`, carries the immediate. Pieces must be <= 1 GiB."""
        v, e = self.device.verbs, self.device.verbs.enums
        wrs = []
        for i, (laddr, length, lkey, raddr, rkey) in enumerate(pieces):
            is_last = i == len(pieces) - 1
            opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM if is_last and imm is not None else e.IBV_WR_RDMA_WRITE
            wr = v.wr.SendWR(
                wr_id=wr_id if is_last else 0,
                opcode=opcode,
                num_sge=1,
                sg=[v.wr.SGE(laddr, length, lkey)],
                imm_data=imm if is_last and imm is not None else 0,
                send_flags=e.IBV_SEND_SIGNALED if is_last else 0,
            )
            wr.set_wr_rdma(rkey, raddr)
            wrs.append(wr)
        for prev, nxt in itertools.pairwise(wrs):
            prev.next_wr = nxt  # pointer into nxt: every wr object stays alive until post_send returns
        try:
            self.qp.post_send(wrs[0])
        finally:
            for wr in wrs:
                wr.close()  # frees the SGE copies; the HCA took its own copy at post time

    def poll_once(self) -> None:
        """Drain the CQ: record finished sends and arrived immediates; raise on a failed completion."""
        e = self.device.verbs.enums
        _, wcs = self.cq.poll(32)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise TransportError(
                    f"RDMA completion failed: status {wc.status}, vendor error {wc.vendor_err}"
                )
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.immediates.add(int(wc.imm_data))
                self.post_receives(1)
            else:
                self.done_wr_ids.add(int(wc.wr_id))

    async def wait_send(self, wr_id: int) -> None:
        await self._spin(lambda: wr_id in self.done_wr_ids)
        self.done_wr_ids.discard(wr_id)

    async def wait_immediate(self, imm: int) -> None:
        await self._spin(lambda: imm in self.immediates)
        self.immediates.discard(imm)

    async def _spin(self, is_done: Any) -> None:
        """Poll until done (the caller's deadline bounds it): yield to the loop, then back off."""
        spins = 0
        while True:
            self.poll_once()
            if is_done():
                return
            spins += 1
            await asyncio.sleep(0 if spins < _BUSY_POLLS else 0.0005)

    def to_error(self) -> None:
        """Flush outstanding work requests (before deregistering memory they may still read)."""
        v, e = self.device.verbs, self.device.verbs.enums
        attr = v.qp.QPAttr(qp_state=e.IBV_QPS_ERR)
        self.qp.modify(attr, e.IBV_QP_STATE)

    def close(self) -> None:
        self.qp.close()
        self.scratch.close()
        self.cq.close()


def split_pieces(
    laddr: int, length: int, lkey: int, raddr: int, rkey: int
) -> list[tuple[int, int, int, int, int]]:
    """One extent as pieces of at most 1 GiB."""
    return [
        (laddr + start, min(_MAX_PIECE_BYTES, length - start), lkey, raddr + start, rkey)
        for start in range(0, max(length, 1), _MAX_PIECE_BYTES)
    ]
