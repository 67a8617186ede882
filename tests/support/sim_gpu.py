"""A simulated GPU for the CUDA copier's tests without CUDA: "device memory" is host
memory and streams run only when told to (kvd.transport.copies.cudacopy's ``_runtime``).

With ``kernels=True`` it also "compiles" the copier's two kernels (after
``compile_delay_s``, or failing with ``compile_error``) and runs them as numpy loops
over the same tables the GPU would read; ``dry=True`` runs nothing at all (the streams
only count ops), so host time can be measured on addresses that point nowhere."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import numpy as np

from kvd.transport.copies.cudacopy import CUDA_MEMCPY_DEFAULT


class SimStream:
    """Copies wait here until the test lets the GPU run (``gpu.run()``) or an event on
    this stream is synchronised."""

    def __init__(self, gpu, device):
        self.gpu, self.device = gpu, device
        self.queue: list = []
        self.done = 0  # ops executed
        self.cuda_stream = id(self)
        gpu.streams[self.cuda_stream] = self

    def wait_stream(self, other):
        """Order after ``other``: the simulated current stream never holds work (the
        copier's callers queue nothing there), so this only checks it is a stream."""
        assert isinstance(other, SimStream) and not other.queue

    def run(self, upto=None):
        with self.gpu.lock:
            upto = len(self.queue) if upto is None else upto
            while self.done < upto:
                op = self.queue[self.done]
                if self.gpu.dry:
                    pass
                elif callable(op):
                    op()
                else:
                    ctypes.memmove(*op)
                self.done += 1


class SimEvent:
    def __init__(self):
        self.stream, self.mark = None, 0

    def record(self, stream):
        self.stream, self.mark = stream, len(stream.queue)

    def query(self):
        if self.stream.gpu.auto:
            self.stream.run(self.mark)
        return self.stream.done >= self.mark

    def synchronize(self):
        self.stream.run(self.mark)


class SimPinned:
    def __init__(self, n):
        self.buf = np.zeros(n, dtype=np.uint8)

    def data_ptr(self):
        return self.buf.ctypes.data


class SimTensor:
    """A "tensor" on the simulated GPU or pinned host memory: a numpy array."""

    def __init__(self, arr):
        self.arr = arr

    def pin_memory(self):
        return SimTensor(self.arr.copy())

    def to(self, device, non_blocking=False):
        return SimTensor(self.arr.copy())

    def data_ptr(self):
        return self.arr.ctypes.data


def _moves(rows):
    for d, s, n in rows:
        ctypes.memmove(int(d), int(s), int(n))


class SimKernel:
    """The copier's kernels as the GPU runs them, over the very tables it uploads."""

    def __init__(self, gpu, name):
        self.gpu, self.name = gpu, name

    def __call__(self, grid, block, args, stream):
        self.gpu.launches.append((self.name, grid, args))
        stream.queue.append(lambda: self._run(*args))

    def _run(self, table, *rest):
        t = table.arr
        if self.name == "kvd_gather_copy":
            _moves(t[:rest[0]].tolist())
            return
        nchunks, ids, nblocks, d0, s0 = rest
        if nblocks:
            dst_ids, src_ids = ids.arr[:nblocks], ids.arr[nblocks:2 * nblocks]
        else:
            dst_ids, src_ids = np.array([d0]), np.array([s0])
        t = t[:nchunks]
        for di, si in zip(dst_ids.tolist(), src_ids.tolist(), strict=True):
            _moves(zip((t[:, 0] + di * t[:, 3]).tolist(), (t[:, 1] + si * t[:, 4]).tolist(),
                       t[:, 2].tolist(), strict=True))


class SimGpu:
    """Stands in for both torch (``cuda`` namespace, ``empty``, ``from_numpy``) and
    libcudart."""

    uint8 = "uint8"

    def __init__(self, auto=True, fail_at=None, kernels=False, dry=False,
                 compile_delay_s=0.0, compile_error=None, devices=2):
        self.auto = auto
        self.dry = dry
        self.launches: list = []
        self.compiled: list = []  # (name, thread name) of each kernel built
        self.set_device: list = []  # (device, thread name) of each cudaSetDevice
        self.lock = threading.RLock()
        self.streams: dict[int, SimStream] = {}
        self.current: dict[int, SimStream] = {}
        self.calls = 0
        self.fail_at = fail_at
        gpu = self

        class Cuda:
            @staticmethod
            def Stream(device):  # noqa: N802 - torch's name
                return SimStream(gpu, device)

            Event = SimEvent

            @staticmethod
            def current_stream(device):
                return gpu.current.setdefault(device, SimStream(gpu, device))

            @staticmethod
            def device(d):
                return contextlib.nullcontext()

            @staticmethod
            def can_device_access_peer(a, b):
                return True

            @staticmethod
            def device_count():
                return devices

            @staticmethod
            def stream(s):
                return contextlib.nullcontext()

        if kernels:
            def compile_kernel(source, name):
                time.sleep(compile_delay_s)
                if compile_error is not None:
                    raise RuntimeError(compile_error)
                gpu.compiled.append((name, threading.current_thread().name))
                return SimKernel(gpu, name)

            Cuda._compile_kernel = staticmethod(compile_kernel)
        self.cuda = Cuda

    @staticmethod
    def from_numpy(arr):
        return SimTensor(arr)

    def empty(self, n, dtype, pin_memory):
        assert pin_memory
        return SimPinned(n)

    def run(self):
        for s in list(self.streams.values()):
            s.run()

    # libcudart
    def cudaMemcpyAsync(self, dst, src, n, kind, stream):  # noqa: N802
        assert kind == CUDA_MEMCPY_DEFAULT
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            return 1
        self.streams[stream].queue.append((dst, src, n))
        return 0

    def cudaDeviceEnablePeerAccess(self, peer, flags):  # noqa: N802
        return 0

    def cudaSetDevice(self, device):  # noqa: N802
        self.set_device.append((device, threading.current_thread().name))
        return 0

    def cudaFree(self, ptr):  # noqa: N802
        return 0

    def cudaGetLastError(self):  # noqa: N802
        return 0

    def cudaRuntimeGetVersion(self, out):  # noqa: N802
        out._obj.value = 12080
        return 0

    def cudaGetErrorString(self, rc):  # noqa: N802
        return b"simulated failure"
