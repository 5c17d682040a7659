"""Memory on 2 MB pages, for the big buffers the CPU kernels stream through: packed weights and the KV pool.

A decode step reads ~100 MB of weights and, at many sequences, hundreds of MB of keys and values, in runs of
a few KB spread over the whole buffer. On 4 KB pages nearly every run starts with a TLB miss and a page walk.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of uninitialized uint8 starting on a 2 MB boundary, advised for transparent huge pages.

    Linux in `madvise` mode (the common default) backs memory with 2 MB pages only where asked; a best-effort
    request: where THP is off, or off Linux, the buffer is the same memory on 4 KB pages. Advise before the
    first write: pages are chosen when first touched."""
    return _advised(torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8), nbytes)


def zeroed_huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros on a 2 MB boundary, advised for huge pages, that take no memory until written.

    Fresh anonymous pages read as zeros by the kernel's guarantee, so a cache that must start zeroed (the KV
    pool) need not write them: memset-ing a 1 GiB pool cost a restart 1.6 s (first touch of huge pages, maybe
    compacting first) and made the whole pool resident before a request used it. Each 2 MB page now becomes
    resident on its first write; the registry's estimate still counts the pool whole."""
    # private (the default, shared, would be shmem, which takes no transparent huge pages), anonymous: zeros
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return _advised(torch.frombuffer(mapping, dtype=torch.uint8), nbytes)  # the tensor keeps `mapping` alive


def _advised(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` of `raw` (one huge page longer) from its first 2 MB boundary, its whole pages advised."""
    start = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[start : start + nbytes]
    whole_pages = nbytes // HUGE_PAGE * HUGE_PAGE
    if sys.platform.startswith("linux") and whole_pages:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(whole_pages), _MADV_HUGEPAGE)
    return buffer
