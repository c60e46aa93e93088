"""Segments left by a dead receiver are swept; those of live owners and other namespaces are not."""

from __future__ import annotations

import subprocess
import sys
import uuid

from shared.shm import ShmSegment, segment_path
from shared.transport.segments import (
    control_socket_path,
    is_control_socket_path,
    segment_prefix,
    sweep_stale_segments,
)


def test_sweep_removes_only_dead_owners_in_this_namespace() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)  # exited: its pid is free (reuse within this test is not a concern)
    uid = uuid.uuid4().hex[:12]
    mine = segment_prefix(uid)
    namespace, own_pid = mine.split("-")[2:4]
    names = {
        "dead": f"kvpath-rx-{namespace}-{dead_pid}-{uid}-1",
        "alive": f"{mine}-1",
        "other_namespace": f"kvpath-rx-1-{dead_pid}-{uid}-1",
        "not_ours": f"kvpath-rx-{namespace}-{dead_pid}-zz",
    }
    assert own_pid.isdigit()
    segments = [ShmSegment.create(name, 64) for name in names.values()]
    try:
        assert sweep_stale_segments() >= 1
        assert not segment_path(names["dead"]).exists()
        for key in ("alive", "other_namespace", "not_ours"):
            assert segment_path(names[key]).exists(), key
    finally:
        for segment in segments:
            segment.close()


def test_only_a_receivers_control_socket_path_is_accepted_from_an_endpoint() -> None:
    uid = uuid.uuid4().hex[:12]
    path = control_socket_path(uid)
    assert path.parent == segment_path("probe").parent and path.name == f"{segment_prefix(uid)}-ctl"
    assert is_control_socket_path(str(path))
    for other in (
        "/var/run/docker.sock",
        str(path.parent / "kvpath-rx-1-2-abc-probe"),  # a segment, not a socket
        str(path.parent / "sub" / path.name),
        f"/nonexistent/{path.name}",
        str(path) + "-x",
    ):
        assert not is_control_socket_path(other), other
