"""Positional reads of tensor slices out of a raw (safetensors-style) file: no mmap.

A tensor stored row-major at byte ``offset`` of a file is seen as ``[outer, size, inner]`` around
the dim being sliced. Its slice ``[a, b)`` of that dim is ``outer`` runs of ``(b - a) * inner``
elements, one every ``size * inner`` elements:

* ``outer == 1`` (dim 0, or the whole tensor): ONE contiguous byte range, read straight into the
  destination's memory when no dtype conversion is asked, else through a bounded staging buffer
  (≤ :data:`STAGE_BYTES`) converted chunk by chunk into the destination;
* runs of at least :data:`RUN_BYTES`: each run is such a contiguous range, read as above;
* shorter runs (a column slice of a row-major ``[out, in]`` weight): the byte span from the first
  run to the last of a group of rows is read into the staging buffer, and the wanted columns are
  copied (converted) out of it; groups are as many rows as fit in :data:`STAGE_BYTES`.

So a process only ever holds its destination tensors plus one staging buffer: no file page is
mapped into it, whatever columns it skips.
"""

from __future__ import annotations

import math
import os

import torch

from .errors import CheckpointError

#: the staging buffer's size bound (bytes): chunked dtype conversion and column slicing
STAGE_BYTES = 64 << 20
#: runs at least this long are read one by one (no bytes read that are not kept)
RUN_BYTES = 1 << 20
#: advise the kernel to drop the page-cache pages of every range once read
#: (``posix_fadvise(DONTNEED)``). Off by default: tensor-parallel ranks read the same files at the
#: same time (column slices span whole rows, replicated tensors are read by every rank), so one
#: rank dropping pages makes the others read them from disk again.
DROP_PAGE_CACHE = False
_MAX_IO = 0x7FFFF000  # Linux caps one read(2) at this many bytes


class StagingBuffer:
    """One reusable uint8 buffer, grown on demand up to the largest chunk asked (≤ STAGE_BYTES
    for the chunked paths)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]

    def release(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)


def pread_into(fd: int, dest: torch.Tensor, offset: int, path: object = "") -> None:
    """Fill the contiguous uint8 tensor ``dest`` with the file's bytes at ``offset``."""
    view = memoryview(dest.numpy()).cast("B")
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:done + _MAX_IO]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path} is truncated: {total - done} bytes missing at offset "
                                  f"{offset + done} (the file changed after its header was "
                                  f"read?); re-download or re-save it")
        done += n
    if DROP_PAGE_CACHE and total and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view of a contiguous tensor's memory."""
    assert t.is_contiguous(), "reads go straight into contiguous memory"
    return t.reshape(-1).view(torch.uint8)


def read_contiguous(fd: int, offset: int, dest: torch.Tensor, src_dtype: torch.dtype,
                    stage: StagingBuffer, path: object = "") -> None:
    """Fill the flat contiguous ``dest`` with ``dest.numel()`` elements of ``src_dtype`` stored
    at ``offset``: directly when the dtypes agree, else via the staging buffer in chunks."""
    n = dest.numel()
    if n == 0:
        return
    if dest.dtype == src_dtype:
        pread_into(fd, _bytes_of(dest), offset, path)
        return
    item = src_dtype.itemsize
    step = max(1, STAGE_BYTES // item)
    for i in range(0, n, step):
        m = min(step, n - i)
        buf = stage.get(m * item)
        pread_into(fd, buf, offset + i * item, path)
        dest[i:i + m].copy_(buf.view(src_dtype))


def read_slice(fd: int, offset: int, shape: tuple[int, ...], src_dtype: torch.dtype,
               dim: int | None, a: int, b: int, out_dtype: torch.dtype, stage: StagingBuffer,
               path: object = "") -> torch.Tensor:
    """A fresh contiguous ``out_dtype`` tensor holding ``[a, b)`` of ``dim`` (None: all) of the
    row-major ``src_dtype`` tensor of ``shape`` stored at byte ``offset`` of ``fd``."""
    if dim is None:
        out = torch.empty(shape, dtype=out_dtype)
        read_contiguous(fd, offset, out.reshape(-1), src_dtype, stage, path)
        return out
    out_shape = list(shape)
    out_shape[dim] = b - a
    out = torch.empty(out_shape, dtype=out_dtype)
    if out.numel() == 0:
        return out
    item = src_dtype.itemsize
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    run, stride = (b - a) * inner, shape[dim] * inner  # elements
    first = offset + a * inner * item
    dest = out.view(outer, run)
    if outer == 1:
        read_contiguous(fd, first, dest[0], src_dtype, stage, path)
    elif run * item >= RUN_BYTES:
        for o in range(outer):
            read_contiguous(fd, first + o * stride * item, dest[o], src_dtype, stage, path)
    else:
        rows = max(1, STAGE_BYTES // (stride * item))
        for o in range(0, outer, rows):
            k = min(rows, outer - o)
            span = (k - 1) * stride + run  # elements from the first run's start to the last's end
            buf = stage.get(span * item)
            pread_into(fd, buf, first + o * stride * item, path)
            dest[o:o + k].copy_(buf.view(src_dtype).as_strided((k, run), (stride, 1)))
    return out
