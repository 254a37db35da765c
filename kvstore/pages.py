"""What the system's memory pages are like, for the buffers that long-lived data and disk reads use.

- `huge_pages(nbytes)`: a new flat uint8 array from an anonymous mapping whose whole 2 MiB pages
  are advised for transparent huge pages (Linux, THP in `always` or `madvise` mode); None where
  they cannot apply.
- `free_pages_reported()`: whether a virtio balloon of this (guest) system reports free memory to
  its host (free page reporting, in blocks of 2 MiB), which takes it back: a fresh huge page is then
  faulted in from the host, 3 ms (AMD EPYC, Zen 1 kind, KVM: 64 MiB in 99 ms, small pages 25 ms) to
  10-20 ms (Intel Xeon with AMX, KVM) a page, where a huge page the system already holds (freed a
  moment ago, or kept) costs what small ones do.

`engine.buffers` makes the engine's long-lived buffers from these; `direct_io` its bounce buffer.
Imports nothing of kvstore.
"""

from __future__ import annotations

import mmap
from functools import lru_cache
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20


def huge_pages(nbytes: int) -> np.ndarray | None:
    """A new flat uint8 array of nbytes (zeros) starting on a 2 MiB boundary, its whole 2 MiB pages
    advised for huge pages; None where they cannot apply (under 2 MiB, no THP on this system)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_ANONYMOUS") or nbytes < HUGE_PAGE:
        return None
    # private: a shared anonymous mapping is shmem, which THP leaves alone; one huge page more, to
    # start the buffer on a huge page boundary
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, np.uint8)  # keeps `region` mapped as long as any view of it lives
    start = -whole.ctypes.data % HUGE_PAGE
    try:
        region.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages
        return None
    return whole[start:start + nbytes]


BALLOONS = Path("/sys/bus/virtio/drivers/virtio_balloon")
VIRTIO_BALLOON_F_REPORTING = 5  # the device's feature bit for free page reporting (virtio spec)


@lru_cache(maxsize=1)
def free_pages_reported() -> bool:
    """Whether a virtio balloon device of this (guest) system reports free pages to its host: the
    `features` file of each device is its feature bits as '0'/'1' characters, bit 0 first."""
    for device in BALLOONS.glob("virtio*"):
        try:
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > VIRTIO_BALLOON_F_REPORTING and features[VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False
