"""FakeVerbs: an in-memory stand-in for pyverbs, because this machine has no RDMA device.

It exists only so the rdma backend's own logic (queue pair setup, WR chains and batching, signaled
completions, write-with-immediate joined to the NOTICE frame, credits, errors) runs in tests here. It
mimics the pyverbs calls the backend makes, with RC semantics reduced to one process: a posted RDMA
WRITE checks the lkey/rkey bounds and access, memmoves the bytes, consumes a receive WR for an
immediate and queues completions. It proves nothing about real pyverbs or a real HCA; the tests marked
`rdma` in test_transport_rdma.py do, on a machine with a device.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from shared.transport.rdma_verbs import Verbs

E = SimpleNamespace(
    IBV_PORT_ACTIVE=4,
    IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
    IBV_GID_TYPE_SYSFS_ROCE_V2=1,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_QPT_RC=2,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_WRITE_WITH_IMM=1,
    IBV_SEND_SIGNALED=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RNR_RETRY_EXC_ERR=13,
    IBV_WC_RDMA_WRITE=1,
    IBV_WC_RECV_RDMA_WITH_IMM=129,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_QP_STATE=1,
)
_keys = itertools.count(0x1000)
_qp_nums = itertools.count(100)
_MRS: dict[int, FakeMR] = {}  # lkey/rkey -> MR (the fake uses one key for both)
_QPS: dict[int, FakeQP] = {}
STATS = {"posts": 0, "writes": 0, "registrations": 0}


def _attrs(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**kw)


class Context:
    def __init__(self, name: str) -> None:
        self.name = name

    def query_port(self, port: int) -> SimpleNamespace:
        return _attrs(
            state=E.IBV_PORT_ACTIVE, lid=7, active_mtu=3, link_layer=E.IBV_LINK_LAYER_ETHERNET, gid_tbl_len=2
        )

    def query_gid(self, port: int, index: int) -> SimpleNamespace:
        gids = ["0000:0000:0000:0000:0000:0000:0000:0000", "0000:0000:0000:0000:0000:ffff:0a00:0001"]
        return _attrs(gid=gids[index])

    def query_gid_type(self, port: int, index: int) -> int:
        return E.IBV_GID_TYPE_SYSFS_ROCE_V2

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def close(self) -> None:
        pass


class FakeMR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
        self._own = None if address else ctypes.create_string_buffer(max(length, 1))
        self.buf = address or ctypes.addressof(self._own)  # type: ignore[arg-type]
        self.length = length
        self.access = access
        self.lkey = self.rkey = next(_keys)
        _MRS[self.lkey] = self
        STATS["registrations"] += 1

    def covers(self, addr: int, length: int) -> bool:
        return self.buf <= addr and addr + length <= self.buf + self.length

    def close(self) -> None:
        _MRS.pop(self.lkey, None)


@dataclass
class WC:
    wr_id: int
    status: int
    opcode: int
    imm_data: int = 0
    vendor_err: int = 0


class CQ:
    def __init__(self, ctx: Context, cqe: int, cq_context: Any, channel: Any, comp_vector: int) -> None:
        self.entries: deque[WC] = deque()

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        return len(out), out

    def close(self) -> None:
        pass


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = 0,
        num_sge: int = 0,
        imm_data: int = 0,
        sg: list[SGE] | None = None,
        send_flags: int = 0,
        next_wr: Any = None,
    ) -> None:
        if num_sge < 1 or not sg:
            raise ValueError("A WR needs at least one SGE")  # as pyverbs
        self.wr_id, self.opcode, self.imm_data, self.send_flags = wr_id, opcode, imm_data, send_flags
        self.sge = sg[0]
        self.next_wr: SendWR | None = next_wr
        self.remote = (0, 0)

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.remote = (rkey, addr)

    def close(self) -> None:
        pass


class RecvWR:
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: list[SGE] | None = None) -> None:
        if num_sge < 1 or not sg:
            raise ValueError("A WR needs at least one SGE")
        self.wr_id = wr_id

    def close(self) -> None:
        pass


class QPCap:
    def __init__(self, **kw: int) -> None:
        self.__dict__.update(kw)


class QPInitAttr:
    def __init__(self, qp_type: int, scq: CQ, rcq: CQ, cap: QPCap, sq_sig_all: int = 0) -> None:
        self.scq, self.rcq, self.cap = scq, rcq, cap


class QPAttr:
    def __init__(self, port_num: int = 1, qp_state: int = 0) -> None:
        self.port_num, self.qp_state = port_num, qp_state
        self.qp_access_flags = 0


@dataclass
class FakeQP:
    init: QPInitAttr
    access: int
    qp_num: int = field(default_factory=lambda: next(_qp_nums))
    state: int = 0
    dest: int = -1
    receives: int = 0

    def to_rts(self, attr: QPAttr) -> None:
        assert attr.path_mtu and attr.rnr_retry == 7 and attr.dest_qp_num in _QPS  # type: ignore[attr-defined]
        self.dest, self.state = attr.dest_qp_num, E.IBV_QPS_RTS  # type: ignore[attr-defined]
        self.access = attr.qp_access_flags

    def post_recv(self, wr: RecvWR) -> None:
        self.receives += 1

    def post_send(self, wr: SendWR) -> None:
        STATS["posts"] += 1
        chain: SendWR | None = wr
        while chain is not None:
            self._execute(chain)
            chain = chain.next_wr

    def _execute(self, wr: SendWR) -> None:
        if self.state != E.IBV_QPS_RTS:
            self.init.scq.entries.append(WC(wr.wr_id, E.IBV_WC_REM_ACCESS_ERR, E.IBV_WC_RDMA_WRITE))
            return
        local, (rkey, raddr) = _MRS.get(wr.sge.lkey), wr.remote
        remote, peer = _MRS.get(rkey), _QPS[self.dest]
        length = wr.sge.length
        ok = local is not None and local.covers(wr.sge.addr, length)
        ok = ok and remote is not None and remote.covers(raddr, length)
        ok = ok and bool(remote.access & E.IBV_ACCESS_REMOTE_WRITE) if remote else False
        if not ok:
            self.state = peer.state = E.IBV_QPS_ERR
            self.init.scq.entries.append(WC(wr.wr_id, E.IBV_WC_REM_ACCESS_ERR, E.IBV_WC_RDMA_WRITE))
            return
        ctypes.memmove(raddr, wr.sge.addr, length)
        STATS["writes"] += 1
        if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
            if not peer.receives:
                self.state = E.IBV_QPS_ERR
                self.init.scq.entries.append(WC(wr.wr_id, E.IBV_WC_RNR_RETRY_EXC_ERR, E.IBV_WC_RDMA_WRITE))
                return
            peer.receives -= 1
            peer.init.rcq.entries.append(WC(0, E.IBV_WC_SUCCESS, E.IBV_WC_RECV_RDMA_WITH_IMM, wr.imm_data))
        if wr.send_flags & E.IBV_SEND_SIGNALED:
            self.init.scq.entries.append(WC(wr.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_RDMA_WRITE))

    def modify(self, attr: QPAttr, mask: int) -> None:
        self.state = attr.qp_state

    def close(self) -> None:
        _QPS.pop(self.qp_num, None)


def QP(pd: PD, init: QPInitAttr, attr: QPAttr) -> FakeQP:
    qp = FakeQP(init, attr.qp_access_flags)
    _QPS[qp.qp_num] = qp
    return qp


class GID:
    gid = ""


def fake_verbs() -> Verbs:
    device = SimpleNamespace(get_device_list=lambda: [_attrs(name=b"fake0")], Context=Context)
    return Verbs(
        device=device,
        pd=SimpleNamespace(PD=PD),
        mr=SimpleNamespace(MR=FakeMR),
        cq=SimpleNamespace(CQ=CQ),
        qp=SimpleNamespace(QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr),
        wr=SimpleNamespace(SGE=SGE, SendWR=SendWR, RecvWR=RecvWR),
        addr=SimpleNamespace(
            GID=GID, GlobalRoute=lambda **kw: _attrs(**kw), AHAttr=lambda **kw: _attrs(**kw)
        ),
        enums=E,
    )
