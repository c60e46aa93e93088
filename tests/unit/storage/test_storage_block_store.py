"""Block files: header, atomic writes, verified reads; torn, truncated, foreign, rotten files are misses."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from services.storage.block_store import HEADER_BYTES, BlockHeader, BlockStore, ReadOutcome
from shared.errors import StorageError, StorageFullError

FP, OTHER_FP = 0x1111, 0x2222
PAYLOAD = np.arange(1000, dtype=np.uint32).view(np.uint8)  # 4000 bytes


def _store(tmp_path: Path, policy: str = "file") -> BlockStore:
    return BlockStore(tmp_path / "root", node=3, fsync_policy=policy)


@pytest.mark.parametrize("policy", ["none", "file", "dir"])
def test_write_then_read_into_a_buffer(tmp_path: Path, policy: str) -> None:
    store = _store(tmp_path, policy)
    assert store.write(FP, 0xABCDEF, 0x42, PAYLOAD.data) == HEADER_BYTES + PAYLOAD.nbytes
    path = store.path_for(FP, 0xABCDEF)
    assert path.relative_to(store.root).parts == (f"{FP:016x}", "00", "00", "0000000000abcdef.blk")
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # the temp file was renamed
    dest = np.zeros(PAYLOAD.nbytes + 100, np.uint8)
    assert store.read_into(FP, 0xABCDEF, dest[50 : 50 + PAYLOAD.nbytes].data) is ReadOutcome.OK
    assert np.array_equal(dest[50 : 50 + PAYLOAD.nbytes], PAYLOAD)
    assert not dest[:50].any() and not dest[-50:].any()
    header = BlockHeader.unpack(path.read_bytes()[:HEADER_BYTES])
    assert header is not None and (header.writer_node, header.parent_hash) == (3, 0x42)
    assert store.exists(FP, 0xABCDEF, PAYLOAD.nbytes) and not store.exists(FP, 0xABCDEF, 10)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 7]
    elif how == "torn_header":
        data = data[:30]
    elif how == "payload_bit":
        data[HEADER_BYTES + 123] ^= 0x01
    elif how == "header_bit":
        data[40] ^= 0x80
    elif how == "trailing":
        data += b"x"
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how", ["truncated", "torn_header", "payload_bit", "header_bit", "trailing", "empty"]
)
def test_damaged_files_are_corrupt_and_removed(tmp_path: Path, how: str) -> None:
    store = _store(tmp_path)
    store.write(FP, 7, 0, PAYLOAD.data)
    _damage(store.path_for(FP, 7), how)
    dest = np.zeros(PAYLOAD.nbytes, np.uint8)
    assert store.read_into(FP, 7, dest.data) is ReadOutcome.CORRUPT
    assert not store.path_for(FP, 7).exists()
    assert store.read_into(FP, 7, dest.data) is ReadOutcome.MISSING


def test_foreign_fingerprint_and_wrong_hash(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(OTHER_FP, 7, 0, PAYLOAD.data)
    # a file of another model copied to where this model's block 7 lives
    os.makedirs(store.path_for(FP, 7).parent, exist_ok=True)
    os.replace(store.path_for(OTHER_FP, 7), store.path_for(FP, 7))
    dest = np.zeros(PAYLOAD.nbytes, np.uint8)
    assert store.read_into(FP, 7, dest.data) is ReadOutcome.FOREIGN
    assert not store.path_for(FP, 7).exists()
    store.write(FP, 8, 0, PAYLOAD.data)
    os.replace(store.path_for(FP, 8), store.path_for(FP, 9))
    assert store.read_into(FP, 9, dest.data) is ReadOutcome.CORRUPT
    # asking with another block size is not a hit either
    store.write(FP, 10, 0, PAYLOAD.data)
    assert store.read_into(FP, 10, np.zeros(PAYLOAD.nbytes // 2, np.uint8).data) is ReadOutcome.CORRUPT


def test_unverified_read_skips_only_the_payload_checksum(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(FP, 7, 0, PAYLOAD.data)
    _damage(store.path_for(FP, 7), "payload_bit")
    dest = np.zeros(PAYLOAD.nbytes, np.uint8)
    assert store.read_into(FP, 7, dest.data, verify=False) is ReadOutcome.OK
    _damage(store.path_for(FP, 7), "truncated")
    assert store.read_into(FP, 7, dest.data, verify=False) is ReadOutcome.CORRUPT


def test_scan_finds_blocks_and_drops_stale_temp_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for h in (1, 2, 0xFFFF_FFFF_FFFF_FFFF):
        store.write(FP, h, 0, PAYLOAD.data)
    other_node = BlockStore(store.root, node=4)
    other_node.write(OTHER_FP, 5, 0, PAYLOAD.data)
    stale = store.path_for(FP, 1).with_name("0000000000000001.blk.tmp-dead")
    stale.write_bytes(b"torn")
    os.utime(stale, (1, 1))
    fresh = store.path_for(FP, 2).with_name("0000000000000002.blk.tmp-live")
    fresh.write_bytes(b"being written")
    found = {(b.fingerprint_hash, b.block_hash) for b in store.scan(only_own=False)}
    assert found == {(FP, 1), (FP, 2), (FP, 0xFFFF_FFFF_FFFF_FFFF), (OTHER_FP, 5)}
    own = {(b.fingerprint_hash, b.block_hash) for b in store.scan(only_own=True)}
    assert own == {(FP, 1), (FP, 2), (FP, 0xFFFF_FFFF_FFFF_FFFF)}
    assert not stale.exists() and fresh.exists()


def test_write_errors_are_storage_errors(tmp_path: Path) -> None:
    store = _store(tmp_path)
    # a file where the fan-out directory should be: the write fails cleanly and leaves nothing behind
    blocker = store.root / f"{FP:016x}"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"not a directory")
    with pytest.raises(StorageError, match="cannot write block"):
        store.write(FP, 2, 0, PAYLOAD.data)
    assert blocker.read_bytes() == b"not a directory"


def test_a_full_file_system_is_reported_as_storage_full(small_fs: Path) -> None:
    store = BlockStore(small_fs, node=0)
    big = np.zeros(48 * 1024, np.uint8)
    store.write(FP, 1, 0, big.data)
    with pytest.raises(StorageFullError, match="storage full"):
        for h in range(2, 10):
            store.write(FP, h, 0, big.data)
    assert not [p for p in small_fs.rglob("*.tmp-*")]  # no temp file left behind


def test_a_run_reads_blocks_side_by_side_and_stops_after_the_first_bad_one(tmp_path: Path) -> None:
    store = _store(tmp_path, "none")
    payloads = [(PAYLOAD + i).astype(np.uint8) for i in range(4)]
    for i, payload in enumerate(payloads):
        store.write(FP, 100 + i, 0, payload.data)
    dest = np.zeros(4 * PAYLOAD.nbytes, np.uint8)
    assert store.read_run_into(FP, [100, 101, 102, 103], dest.data) == [ReadOutcome.OK] * 4
    assert np.array_equal(dest, np.concatenate(payloads))
    _damage(store.path_for(FP, 102), "payload_bit")
    dest[:] = 0
    outcomes = store.read_run_into(FP, [100, 101, 102, 103], dest.data)
    assert outcomes == [ReadOutcome.OK, ReadOutcome.OK, ReadOutcome.CORRUPT]
    assert np.array_equal(dest[: 2 * PAYLOAD.nbytes], np.concatenate(payloads[:2]))
    assert not store.path_for(FP, 102).exists() and store.path_for(FP, 103).exists()
    assert not dest[3 * PAYLOAD.nbytes :].any()  # nothing read past the bad block


@pytest.mark.parametrize("how", ["", "payload_bit_late", "truncated", "trailing"])
def test_a_large_block_is_verified_to_its_last_byte(tmp_path: Path, how: str) -> None:
    store = _store(tmp_path, "none")
    payload = np.random.default_rng(1).integers(0, 256, 600_000, dtype=np.uint8)
    store.write(FP, 5, 0, payload.data)
    path = store.path_for(FP, 5)
    data = bytearray(path.read_bytes())
    if how == "payload_bit_late":
        data[-10] ^= 0x04
    elif how == "truncated":
        data = data[: HEADER_BYTES + 300_007]
    elif how == "trailing":
        data += b"x"
    path.write_bytes(bytes(data))
    dest = np.zeros(payload.nbytes, np.uint8)
    outcome = store.read_into(FP, 5, dest.data)
    assert outcome is (ReadOutcome.CORRUPT if how else ReadOutcome.OK)
    if not how:
        assert np.array_equal(dest, payload)
