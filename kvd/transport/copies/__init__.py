"""Copies between pools this process maps (the "local" and "host" paths of a pull).

``localcopy``: DRAM to DRAM on copy threads (``copyplan`` cuts a copy into shares,
``nativecopy`` copies a share in one C call, ``memcpy_batch.c``); ``cudacopy``: VRAM,
and DRAM to or from VRAM, on CUDA streams (``gather``: its kernel). Both follow
`kvd.transport.base.Copier`.
"""
