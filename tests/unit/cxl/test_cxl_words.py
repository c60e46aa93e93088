"""The single-store assumption the rings rest on: a u64 written through `RpcSegment.u64` by one process is
never seen half-written (or zeroed, as struct.pack_into would show it) by another."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from shared.cxl.segment import RpcSegment
from shared.shm import segment_path

A, B = 0x1111_1111_1111_1111, 0xEEEE_EEEE_EEEE_EEEE
WRITER = """
import sys
from shared.cxl.segment import RpcSegment
segment = RpcSegment.attach(sys.argv[1])
u64 = segment.u64
u64[9] = 1  # "started"
for i in range(int(sys.argv[2])):
    u64[8] = {A} if i & 1 else {B}
u64[9] = 2  # "done"
segment.close()
"""


def test_a_concurrent_reader_sees_only_whole_values() -> None:
    name = "kvpath-test-cxl-words-" + uuid.uuid4().hex[:8]
    segment = RpcSegment.create(name, 4096)
    try:
        u64 = segment.u64
        u64[8] = A
        code = WRITER.format(A=A, B=B)
        writer = subprocess.Popen([sys.executable, "-c", code, name, "2000000"])
        deadline = time.monotonic() + 30
        seen, torn = set(), 0
        while u64[9] != 2:
            assert time.monotonic() < deadline, "the writer never finished"
            for _ in range(1000):
                value = u64[8]
                if value != A and value != B:
                    torn += 1
                seen.add(value)
        assert writer.wait(10) == 0
        assert torn == 0 and seen <= {A, B}
    finally:
        segment.close()
    assert not segment_path(name).exists()
