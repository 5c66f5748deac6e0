"""The kernel's base page size, read from the root it runs under, never assumed.

arm64 kernels are built for 4, 16 or 64 KiB pages (the Raspberry Pi 5's kernel_2712 uses
16 KiB), and memory cgroup limits are kept in pages (``memory.max`` reads back rounded down to
one), so a limit planned in 4 KiB steps would not verify there.  On the host it is
``sysconf(_SC_PAGESIZE)``.  Below another root it is what that tree says
(docs/kernel-facts/ineffective.md, "Page size"): ``KernelPageSize`` of ``/proc/self/smaps``
(Documentation/filesystems/proc.rst), else derived from THP's ``hpage_pmd_size`` (a PMD maps
page_size / 8 page-table entries of page_size each on 64-bit kernels: 2 MiB with 4 KiB pages,
32 MiB with 16 KiB, 512 MiB with 64 KiB), else 4096.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

DEFAULT = 4096
SMAPS = "proc/self/smaps"
PMD_SIZE = "sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_KERNEL_PAGE = re.compile(r"^KernelPageSize:\s+(\d+) kB$", re.MULTILINE)


def page_size(is_host: bool, base: Path) -> int:
    """Bytes per base page of the kernel behind a root (``Root.is_host``, ``Root.base``)."""
    return os.sysconf("SC_PAGE_SIZE") if is_host else tree_page_size(base)


def tree_page_size(base: Path) -> int:
    """The page size a tree below ``base`` says it has (see the module docstring)."""
    try:
        found = _KERNEL_PAGE.search((base / SMAPS).read_text())
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    try:
        pmd = int((base / PMD_SIZE).read_text())
    except (OSError, ValueError):
        return DEFAULT
    page = math.isqrt(pmd * 8)
    return page if page * page == pmd * 8 and page & (page - 1) == 0 else DEFAULT
