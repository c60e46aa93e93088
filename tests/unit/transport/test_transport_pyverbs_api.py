"""The pyverbs names and constructors the rdma backend uses exist in the installed pyverbs (runs wherever
python3-pyverbs is installed, device or not; skipped where it cannot be imported)."""

from __future__ import annotations

import pytest

from shared.transport.rdma_verbs import Verbs, load_pyverbs

ENUMS = [
    "IBV_PORT_ACTIVE",
    "IBV_LINK_LAYER_ETHERNET",
    "IBV_GID_TYPE_SYSFS_ROCE_V2",
    "IBV_ACCESS_LOCAL_WRITE",
    "IBV_ACCESS_REMOTE_WRITE",
    "IBV_QPT_RC",
    "IBV_WR_RDMA_WRITE",
    "IBV_WR_RDMA_WRITE_WITH_IMM",
    "IBV_SEND_SIGNALED",
    "IBV_WC_SUCCESS",
    "IBV_WC_RECV_RDMA_WITH_IMM",
    "IBV_QPS_ERR",
    "IBV_QP_STATE",
]


@pytest.fixture(scope="module")
def verbs() -> Verbs:
    try:
        return load_pyverbs()
    except ImportError as exc:
        pytest.skip(f"pyverbs cannot be imported: {exc}")


def test_enums_and_classes_exist(verbs: Verbs) -> None:
    missing = [name for name in ENUMS if not hasattr(verbs.enums, name)]
    assert not missing
    for obj, names in (
        (verbs.device, ["get_device_list", "Context"]),
        (verbs.device.Context, ["query_port", "query_gid", "query_gid_type", "close"]),
        (verbs.cq.CQ, ["poll", "close"]),
        (verbs.qp.QP, ["to_rts", "post_send", "post_recv", "modify", "qp_num", "close"]),
        (verbs.mr.MR, ["buf", "lkey", "rkey", "length", "close"]),
        (verbs.cq.WC, ["wr_id", "status", "opcode", "imm_data", "vendor_err"]),
    ):
        assert [n for n in names if not hasattr(obj, n)] == [], obj


def test_work_requests_build_and_chain(verbs: Verbs) -> None:
    e, wr = verbs.enums, verbs.wr
    first = wr.SendWR(
        wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[wr.SGE(0x1000, 64, 1)], imm_data=0, send_flags=0
    )
    last = wr.SendWR(
        wr_id=7,
        opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
        num_sge=1,
        sg=[wr.SGE(0x2000, 0, 1)],
        imm_data=0xFFFFFFFF,
        send_flags=e.IBV_SEND_SIGNALED,
    )
    last.set_wr_rdma(5, 0x3000)
    first.next_wr = last
    assert last.imm_data == 0xFFFFFFFF and last.wr_id == 7
    recv = wr.RecvWR(wr_id=0, num_sge=1, sg=[wr.SGE(0x1000, 64, 1)])
    for w in (first, last, recv):
        w.close()


def test_queue_pair_attributes_are_settable(verbs: Verbs) -> None:
    e = verbs.enums
    attr = verbs.qp.QPAttr(port_num=1)
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    attr.path_mtu = 3
    attr.dest_qp_num, attr.rq_psn, attr.sq_psn = 17, 123, 456
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    gid = verbs.addr.GID()
    gid.gid = "0000:0000:0000:0000:0000:ffff:0a00:0001"
    route = verbs.addr.GlobalRoute(dgid=gid, sgid_index=1)
    attr.ah_attr = verbs.addr.AHAttr(port_num=1, is_global=1, gr=route, dlid=7)
    attr.ah_attr = verbs.addr.AHAttr(port_num=1, is_global=0, dlid=7)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (17, 123, 456, 3)
    assert verbs.qp.QPAttr(qp_state=e.IBV_QPS_ERR).qp_state == e.IBV_QPS_ERR
    verbs.qp.QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
