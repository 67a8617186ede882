"""The gather kernel a GPU copy of many pieces runs as, and its table (pure).

`kvd.transport.cudacopy.CudaCopier` compiles `GATHER_KERNEL` with NVRTC at first use and
launches it once per lane over the table `chunk_descriptors` builds: one row (dst, src,
nbytes) per chunk of at most `KERNEL_CHUNK_NBYTES`, one thread block per chunk. Why a
kernel and not per-piece copies: docs/notes/2026-11-27-gpu-local-copy.md.
"""

from __future__ import annotations

import numpy as np

KERNEL_CHUNK_NBYTES = 64 << 10  # one thread block's share of a gather-kernel copy
KERNEL_THREADS = 256
KERNEL_MAX_BLOCKS = 1 << 16  # grid-stride beyond this

# dst[i] <- src[i] for every chunk (dst, src, nbytes) of ``desc``: one thread block per
# chunk (grid-stride), 16-, 8- or 1-byte moves as the chunk's alignment allows.
GATHER_KERNEL = r"""
extern "C" __global__ void kvd_gather_copy(const long long* __restrict__ desc, int nchunks) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    unsigned long long dst = (unsigned long long)desc[3 * c];
    unsigned long long src = (unsigned long long)desc[3 * c + 1];
    long long n = desc[3 * c + 2];
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
