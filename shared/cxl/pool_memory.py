"""The KV pool's memory as every process maps it: backing devices, slot interleaving, zero-copy slot views.

Beluga's pool is one large memory that every engine on every host maps and reads with plain loads and stores.
Here it is `num_devices` backing "devices" mapped `MAP_SHARED`: DAX character devices (`/dev/daxX.Y`, devdax)
or files on a hugetlbfs mount when the deployment gives their paths, else files in /dev/shm (the emulation;
same semantics, local DRAM speed). The pool service creates (allocating their memory at once, as a device has
it) or opens them; engines map the same paths.

Slots: the pool holds fixed-size slots, one Full Block each (`BlockLayout.full_block_bytes`), so a slot is a
contiguous `[num_layers, block_size, bytes]` view of one device and a Layer Block a contiguous part of it.
Interleaving (the paper's 2 MB software interleave, §5.3): consecutive logical slots fill a stripe of at least
`interleave_bytes` on one device, then the next stripe goes to the next device, round robin:

    stripe = slot // slots_per_stripe,  device = stripe % num_devices,
    slot's index on its device = (stripe // num_devices) * slots_per_stripe + slot % slots_per_stripe

so a run of allocations spreads over every device instead of piling onto the first (the paper's Exp. #3).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.blocks import BlockLayout
from shared.errors import ConfigError
from shared.shm import segment_path

PAGE_BYTES = 4096
DEFAULT_INTERLEAVE_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """How the pool's slots lie on its devices (the same numbers in every process that maps it)."""

    slot_bytes: int
    num_slots: int
    num_devices: int = 1
    interleave_bytes: int = DEFAULT_INTERLEAVE_BYTES

    def __post_init__(self) -> None:
        for name in ("slot_bytes", "num_slots", "num_devices", "interleave_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"pool {name}={getattr(self, name)}: must be > 0", param=name)

    @property
    def slots_per_stripe(self) -> int:
        return max(1, self.interleave_bytes // self.slot_bytes)

    def locate(self, slot: int) -> tuple[int, int]:
        """(device, byte offset on it) of logical slot `slot`."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"pool slot {slot} outside 0..{self.num_slots - 1}")
        per = self.slots_per_stripe
        stripe, within = divmod(slot, per)
        device, row = stripe % self.num_devices, stripe // self.num_devices
        return device, (row * per + within) * self.slot_bytes

    def locate_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`locate` for an array of slots: (devices, slot indices on their devices)."""
        per = self.slots_per_stripe
        stripe, within = np.divmod(slots.astype(np.int64), per)
        return stripe % self.num_devices, (stripe // self.num_devices) * per + within

    def device_slots(self, device: int) -> int:
        """How many slots device `device` holds (devices differ by at most one stripe)."""
        per = self.slots_per_stripe
        full_stripes, rest = divmod(self.num_slots, per)
        rows, extra = divmod(full_stripes, self.num_devices)
        count = rows * per + (per if device < extra else 0)
        if device == extra:
            count += rest
        return count

    def device_bytes(self, device: int) -> int:
        return _round_up(self.device_slots(device) * self.slot_bytes, PAGE_BYTES)


def device_names(prefix: str, num_devices: int) -> list[str]:
    """Names of the emulated devices (/dev/shm files) of a pool whose segment names start with `prefix`."""
    return [f"{prefix}-dev{d}" for d in range(num_devices)]


class PoolMemory:
    """The pool's devices mapped into this process; slot views are numpy arrays over the mappings.

    The creator (the pool service) owns emulated /dev/shm devices and unlinks them on close; DAX and
    hugetlbfs paths belong to the deployment and are never unlinked.
    """

    def __init__(self, geometry: PoolGeometry, paths: Sequence[str], *, create: bool, owns: bool) -> None:
        if len(paths) != geometry.num_devices:
            raise ConfigError(
                f"pool has {geometry.num_devices} devices but {len(paths)} paths", param="paths"
            )
        self.geometry = geometry
        self.paths = [str(p) for p in paths]
        self._owns = owns
        self._maps: list[mmap.mmap] = []
        self.devices: list[np.ndarray] = []  # one [device_slots, slot_bytes] uint8 view per device
        try:
            for d, path in enumerate(self.paths):
                slots = geometry.device_slots(d)
                if not slots:  # a pool smaller than one stripe per device leaves the last ones empty
                    self.devices.append(np.empty((0, geometry.slot_bytes), dtype=np.uint8))
                    continue
                self._map(path, geometry.device_bytes(d), create=create)
                flat = np.frombuffer(self._maps[-1], dtype=np.uint8, count=slots * geometry.slot_bytes)
                self.devices.append(flat.reshape(slots, geometry.slot_bytes))
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, geometry: PoolGeometry, prefix: str) -> PoolMemory:
        """Emulated devices: fresh /dev/shm files named `<prefix>-dev<k>` (stale ones replaced)."""
        paths = [str(segment_path(name)) for name in device_names(prefix, geometry.num_devices)]
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return cls(geometry, paths, create=True, owns=True)

    @classmethod
    def open(cls, geometry: PoolGeometry, paths: Sequence[str]) -> PoolMemory:
        """Devices that exist already: DAX devices, hugetlbfs files, or another process's emulated ones."""
        return cls(geometry, paths, create=False, owns=False)

    def _map(self, path: str, size: int, *, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                _reserve(fd, path, size)
            elif Path(path).is_file() and os.fstat(fd).st_size < size:
                raise ConfigError(f"pool device {path} holds {os.fstat(fd).st_size} bytes, {size} needed")
            self._maps.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        finally:
            os.close(fd)

    def slot(self, slot: int) -> np.ndarray:
        """The bytes of logical slot `slot`: a writable uint8 view of `slot_bytes`."""
        device, offset = self.geometry.locate(slot)
        return self.devices[device][offset // self.geometry.slot_bytes]

    def block(self, slot: int, layout: BlockLayout) -> np.ndarray:
        """Slot `slot` as a Full Block `[num_layers, block_size, bytes_per_token_layer]`."""
        if layout.full_block_bytes != self.geometry.slot_bytes:
            raise ConfigError(
                f"block of {layout.full_block_bytes} bytes in slots of {self.geometry.slot_bytes}"
            )
        return self.slot(slot).reshape(layout.shape)

    def runs(self, slots: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """Maximal runs of `slots` (in order) that lie consecutively on one device:
        (first index in `slots`, run length, device, first slot index on the device), so a copy of many
        slots is one call per run."""
        if not len(slots):
            return []
        devices, rows = self.geometry.locate_many(np.asarray(slots, dtype=np.int64))
        same = (devices[1:] == devices[:-1]) & (rows[1:] == rows[:-1] + 1)
        starts = np.concatenate(([0], np.flatnonzero(~same) + 1))
        ends = np.concatenate((starts[1:], [len(slots)]))
        return [
            (int(s), int(e - s), int(devices[s]), int(rows[s])) for s, e in zip(starts, ends, strict=True)
        ]

    def close(self) -> None:
        self.devices = []
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                m.close()
        self._maps = []
        if self._owns:
            for path in self.paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._owns = False


def _reserve(fd: int, path: str, size: int) -> None:
    """Allocate an emulated device's memory now, as a real device has it: a tmpfs too small for the pool
    fails here with a clear error instead of a SIGBUS in whichever engine first writes past its end, the
    pages are charged to the pool service's memory (cgroup), not to the engine that touches them first, and
    engines that map the pool find every page present (`shared/cxl/prefault.py` only maps them)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
        raise ConfigError(
            f"pool device {path}: cannot allocate {size} bytes ({exc.strerror}; {free} free there): give the "
            "pool less memory (--capacity-bytes) or its tmpfs more (e.g. docker --shm-size)",
            param="capacity_bytes",
        ) from exc


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
