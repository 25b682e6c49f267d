"""Where a test or benchmark puts an ``shm://`` tier of a given size: /dev/shm is a container's
64 MB by default, too small for a GPU benchmark's prefix (268 MB), and a tier that does not fit
fails its writes (or its ``max_bytes`` check) instead of measuring anything."""

from __future__ import annotations

import os
import tempfile

__all__ = ["memory_root", "free_bytes"]

_HEADROOM = 1.25  # what a tier of N bytes needs free: its records, temporary files and eviction's slack


def free_bytes(path: str) -> tuple[int, int]:
    """``(free, size)`` of the file system at ``path``, in bytes (0s where it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _tmpfs_mounts() -> list[str]:
    try:
        with open("/proc/mounts") as f:
            return [line.split()[1] for line in f if line.split()[2:3] == ["tmpfs"]]
    except OSError:
        return []


def memory_root(needed: int) -> tuple[str, str]:
    """A writable directory with room for an ``shm://`` tier of ``needed`` bytes, and a note
    (empty for /dev/shm): /dev/shm, else another tmpfs with room, else the temporary directory
    (a disk's page cache keeps what was just written, so a load still maps memory). Where none
    has room, /dev/shm and a note saying so."""
    shm_free, shm_size = free_bytes("/dev/shm")
    want = int(needed * _HEADROOM)
    if shm_free >= want:
        return "/dev/shm", ""
    for root in [*(m for m in _tmpfs_mounts() if m != "/dev/shm"), tempfile.gettempdir()]:
        free, _ = free_bytes(root)
        if free >= want and os.access(root, os.W_OK):
            return root, (f"/dev/shm has {shm_free / 1e6:.0f} MB free of {shm_size / 1e6:.0f} MB, "
                          f"{needed / 1e6:.0f} MB wanted: the shm:// tier lives in {root}")
    return "/dev/shm", (f"/dev/shm has {shm_free / 1e6:.0f} MB free of {shm_size / 1e6:.0f} MB and no other "
                        f"directory has {want / 1e6:.0f} MB: shm:// rows will fail")
