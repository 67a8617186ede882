"""A simulated GPU for the CUDA copier's tests without CUDA: "device memory" is host
memory and streams run only when told to (kvd.transport.cudacopy's ``_runtime``)."""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np

from kvd.transport.cudacopy import CUDA_MEMCPY_DEFAULT


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


class SimGpu:
    """Stands in for both torch (``cuda`` namespace, ``empty``) and libcudart."""

    uint8 = "uint8"

    def __init__(self, auto=True, fail_at=None):
        self.auto = auto
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

        self.cuda = Cuda

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

    def cudaGetLastError(self):  # noqa: N802
        return 0

    def cudaRuntimeGetVersion(self, out):  # noqa: N802
        out._obj.value = 12080
        return 0

    def cudaGetErrorString(self, rc):  # noqa: N802
        return b"simulated failure"
