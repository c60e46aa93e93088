"""The rdma backend end to end, twice: against a real RDMA device (marked `rdma`, skipped with the reason
when pyverbs or a device is missing) and against FakeVerbs, an in-memory stand-in for pyverbs that lets
the backend's own logic run on machines without a device (see transport_fake_verbs.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from shared.errors import TransportError
from shared.transport import KvReceiver, KvSender, TransportConfig, rdma
from tests.integration.transport import transport_fake_verbs as fake

CONFIG = TransportConfig(backends=["rdma", "tcp"], rdma_queue_depth=16, notice_join_timeout_s=2.0)


@pytest.fixture(params=["fake", pytest.param("device", marks=pytest.mark.rdma)])
def verbs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    rdma.rdma_available.cache_clear()
    if request.param == "fake":
        monkeypatch.setattr(rdma, "load_pyverbs", fake.fake_verbs)
    else:
        ok, reason = rdma.rdma_available()
        if not ok:
            pytest.skip(f"no usable RDMA device: {reason}")
    yield request.param
    rdma.rdma_available.cache_clear()


@pytest.fixture
async def pair(verbs: str) -> AsyncIterator[tuple[KvReceiver, KvSender]]:
    rx = KvReceiver(CONFIG, receiver_id="rx-rdma")
    await rx.start()
    rx.register_region("buf", 8 << 20)
    tx = KvSender(CONFIG, sender_id="pe-rdma")
    yield rx, tx
    await tx.close()
    await rx.close()


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


async def test_rdma_is_chosen_and_moves_bytes(pair: tuple[KvReceiver, KvSender]) -> None:
    rx, tx = pair
    assert rx.endpoint()["backends"] == ["rdma", "tcp"]
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    assert peer.backend == "rdma"
    data = _pattern(3 << 20, seed=1)
    await peer.write("buf", 4096, data, tag=11, meta=b"layer", timeout_s=10)
    notice = await rx.wait("buf", 11, timeout_s=5, peer_id="pe-rdma")
    assert (notice.meta, notice.nbytes) == (b"layer", data.nbytes)
    assert np.array_equal(rx.region("buf").view(4096, data.nbytes), data)


async def test_many_extents_span_several_chains(verbs: str, pair: tuple[KvReceiver, KvSender]) -> None:
    rx, tx = pair
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    source = _pattern(100 * 4096, seed=2).reshape(100, 4096)
    tx.register_memory(source)  # pre-registered: no per-write registration
    registrations, posts = fake.STATS["registrations"], fake.STATS["posts"]
    offsets = (np.random.default_rng(3).permutation(200)[:100] * 8192).tolist()
    await peer.write_many("buf", list(zip(offsets, source, strict=True)), tag=1, timeout_s=10)
    await rx.wait("buf", 1, timeout_s=5)
    whole = rx.region("buf").array()
    assert np.array_equal(np.stack([whole[o : o + 4096] for o in offsets]), source)
    if verbs == "fake":  # 100 WRs in chains of depth/2 = 8, nothing registered on the way
        assert fake.STATS["posts"] - posts == 13
        assert fake.STATS["registrations"] == registrations
    await peer.write("buf", 0, b"unregistered source", tag=2, timeout_s=5)  # registered for this write
    await rx.wait("buf", 2, timeout_s=5)
    assert bytes(rx.region("buf").view(0, 19)) == b"unregistered source"


async def test_untagged_writes_then_bare_notice(pair: tuple[KvReceiver, KvSender]) -> None:
    rx, tx = pair
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    await asyncio.gather(*(peer.write("buf", i * 100, bytes([i + 1]) * 100, timeout_s=5) for i in range(8)))
    await peer.notify("buf", 99, b"all", timeout_s=5)
    assert (await rx.wait("buf", 99, timeout_s=5)).meta == b"all"
    assert rx.region("buf").view(0, 800).reshape(8, 100)[:, 99].tolist() == list(range(1, 9))


async def test_more_notices_than_receive_slots(pair: tuple[KvReceiver, KvSender]) -> None:
    rx, tx = pair
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    # 40 concurrent notices on a queue pair with 16 receive slots: credits keep the sender within them
    await asyncio.gather(*(peer.write("buf", i * 64, b"x" * 64, tag=i, timeout_s=10) for i in range(40)))
    notices = await asyncio.gather(*(rx.wait("buf", i, timeout_s=5) for i in range(40)))
    assert sorted(n.tag for n in notices) == list(range(40))


async def test_out_of_bounds_is_refused_before_posting(pair: tuple[KvReceiver, KvSender]) -> None:
    rx, tx = pair
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    with pytest.raises(TransportError, match="outside region") as info:
        await peer.write("buf", (8 << 20) - 1, b"ab", tag=1, timeout_s=5)
    assert info.value.param == "offset"
    await peer.write("buf", 0, b"ok", tag=2, timeout_s=5)
    await rx.wait("buf", 2, timeout_s=5)


async def test_failed_completion_breaks_the_peer(verbs: str, pair: tuple[KvReceiver, KvSender]) -> None:
    if verbs != "fake":
        pytest.skip("needs a fault injected into the verbs layer")
    rx, tx = pair
    peer = await tx.connect(rx.endpoint(), timeout_s=5)
    await peer.write("buf", 0, b"first", tag=1, timeout_s=5)
    region = rx.region("buf")
    region.rdma_key.close()  # fault: the remote key goes away behind the sender's back
    with pytest.raises(TransportError, match="RDMA completion failed"):
        await peer.write("buf", 0, b"second", tag=2, timeout_s=5)
    assert not peer.is_open
    with pytest.raises(TransportError, match="lost"):
        await peer.write("buf", 0, b"third", timeout_s=5)


def test_availability_reports_a_reason() -> None:
    rdma.rdma_available.cache_clear()
    ok, detail = rdma.rdma_available()
    assert isinstance(ok, bool) and detail
    if not ok:
        assert "pyverbs" in detail or "device" in detail
