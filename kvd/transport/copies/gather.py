"""The gather kernel a GPU copy of many pieces runs as, and its table (pure).

`kvd.transport.copies.cudacopy.CudaCopier` compiles `GATHER_KERNEL` with NVRTC (on a thread of
its own when the copier starts) and launches it once per lane over the table
`chunk_descriptors` builds: one row (dst, src, nbytes) per chunk of at most
`KERNEL_CHUNK_NBYTES`, one thread block per chunk. Why a
kernel and not per-piece copies: docs/notes/2026-11-27-gpu-local-copy.md.

`BLOCK_KERNEL` is the same copy for a pull given as block ids (`BlockTable`,
`BlockCopy`): the table (one pool pair's descriptors at block pair (0, 0), cut into
chunks by `block_chunks`, with each row's block stride on both sides) goes to the GPU
once; a pull sends only its block ids, and the kernel computes every address. The host's
work per pull then grows with its blocks, never with how finely a block is cut.
"""

from __future__ import annotations

import numpy as np

from kvd.planner.blocks import BlockTable

KERNEL_CHUNK_NBYTES = 64 << 10  # one thread block's share of a gather-kernel copy
KERNEL_THREADS = 256
KERNEL_MAX_BLOCKS = 1 << 16  # grid-stride beyond this

# One thread block's move of one chunk: 16-, 8- or 1-byte moves as its alignment allows.
_MOVE = r"""
__device__ __forceinline__ void kvd_move(unsigned long long dst, unsigned long long src,
                                         long long n) {
  if (((dst | src | (unsigned long long)n) & 15ULL) == 0) {
    const int4* s = (const int4*)src;
    int4* d = (int4*)dst;
    long long m = n >> 4;
    for (long long i = threadIdx.x; i < m; i += blockDim.x) d[i] = s[i];
  } else if (((dst | src | (unsigned long long)n) & 7ULL) == 0) {
    const long long* s = (const long long*)src;
    long long* d = (long long*)dst;
    long long m = n >> 3;
    for (long long i = threadIdx.x; i < m; i += blockDim.x) d[i] = s[i];
  } else {
    const unsigned char* s = (const unsigned char*)src;
    unsigned char* d = (unsigned char*)dst;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  }
}
"""

# dst[i] <- src[i] for every chunk (dst, src, nbytes) of ``desc``: one thread block per
# chunk (grid-stride).
GATHER_KERNEL = _MOVE + r"""
extern "C" __global__ void kvd_gather_copy(const long long* __restrict__ desc, int nchunks) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    kvd_move((unsigned long long)desc[3 * c], (unsigned long long)desc[3 * c + 1],
             desc[3 * c + 2]);
  }
}
"""

# A pull as block ids: ``chunks`` rows (dst, src, nbytes, dst stride, src stride) are the
# table's chunks at block pair (0, 0); ``ids`` holds the pull's ``nblocks`` destination
# ids, then its ``nblocks`` source ids. Work item w = (block b, chunk c): dst + ids[b] *
# dst stride <- src + ids[nblocks + b] * src stride. A one-block pull passes its two ids
# as ``dst_id0``/``src_id0`` with ``nblocks`` = 0 (no upload at all).
BLOCK_KERNEL = _MOVE + r"""
extern "C" __global__ void kvd_block_copy(const long long* __restrict__ chunks, int nchunks,
                                          const int* __restrict__ ids, int nblocks,
                                          int dst_id0, int src_id0) {
  long long blocks = nblocks > 0 ? nblocks : 1;
  long long total = blocks * nchunks;
  for (long long w = blockIdx.x; w < total; w += gridDim.x) {
    long long b = w / nchunks;
    long long c = w - b * nchunks;
    long long di = nblocks > 0 ? (long long)ids[b] : (long long)dst_id0;
    long long si = nblocks > 0 ? (long long)ids[nblocks + b] : (long long)src_id0;
    const long long* t = chunks + 5 * c;
    kvd_move((unsigned long long)(t[0] + di * t[3]), (unsigned long long)(t[1] + si * t[4]),
             t[2]);
  }
}
"""


def chunk_descriptors(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray,
                      chunk_nbytes: int = KERNEL_CHUNK_NBYTES) -> np.ndarray:
    """The gather kernel's table: every piece cut into chunks of at most
    ``chunk_nbytes``, as rows (dst, src, nbytes) of int64, in order. Pure."""
    if chunk_nbytes < 1:
        raise ValueError("chunk_nbytes must be >= 1")
    dst, src, nbytes = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (dst, src, nbytes))
    counts = -(-nbytes // chunk_nbytes)
    piece = np.repeat(np.arange(len(nbytes)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - first) * chunk_nbytes
    table = np.empty((len(piece), 3), dtype=np.int64)
    table[:, 0] = dst[piece] + offset
    table[:, 1] = src[piece] + offset
    table[:, 2] = np.minimum(chunk_nbytes, nbytes[piece] - offset)
    return table


def block_chunks(table: BlockTable, chunk_nbytes: int = KERNEL_CHUNK_NBYTES) -> np.ndarray:
    """The block kernel's table: the rows of ``table`` at block pair (0, 0) cut into
    chunks of at most ``chunk_nbytes``, as rows (dst, src, nbytes, dst stride, src
    stride) of int64, in order. Built once per table. Pure."""
    counts = -(-table.nbytes // chunk_nbytes)
    cut = chunk_descriptors(table.dst, table.src, table.nbytes, chunk_nbytes)
    out = np.empty((len(cut), 5), dtype=np.int64)
    out[:, :3] = cut
    out[:, 3] = np.repeat(table.dst_stride, counts)
    out[:, 4] = np.repeat(table.src_stride, counts)
    return out
