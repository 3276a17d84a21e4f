"""What host-to-device copies cost a host that launches many small kernels, by where the copied
host memory lives: PyTorch's pinned allocation, anonymous memory registered with the driver (with
and without transparent huge pages), and a registered file mapping (the page cache, as ddo's
default tier streams from). Each source feeds back-to-back copies on their own stream while the
main thread times kernel launches and plain interpreter work; a row without copies is the base.

    python gpu_contention.py [--gib 2] [--launches 20000] [--chunk-mib 256]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time

import torch

MADV_HUGEPAGE = 14
CU_MEMHOSTREGISTER_READ_ONLY = 0x08


def driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return cuda


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value


def _map(nbytes: int, prot: int, flags: int, fd: int) -> int:
    ptr = libc.mmap(None, nbytes, prot, flags, fd, 0)
    if ptr in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return ptr


class Source:
    """``nbytes`` of host memory the copies read, and how it was made."""

    def __init__(self, kind: str, nbytes: int, folder: str, cuda: ctypes.CDLL) -> None:
        self.kind, self.nbytes, self.cuda = kind, nbytes, cuda
        self.keep, self.mapped, self.registered = None, False, False
        if kind == "torch pinned":
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            t.fill_(1)
            self.keep, self.ptr = t, t.data_ptr()
            return
        if kind == "file mapping":
            path = os.path.join(folder, "contention.bin")
            with open(path, "wb") as f:
                block = os.urandom(1 << 20)
                for _ in range(nbytes >> 20):
                    f.write(block)
            fd = os.open(path, os.O_RDONLY)
            try:
                self.ptr = _map(nbytes, mmap.PROT_READ, mmap.MAP_SHARED | 0x8000, fd)  # MAP_POPULATE
            finally:
                os.close(fd)
            flags = CU_MEMHOSTREGISTER_READ_ONLY
        else:
            self.ptr = _map(nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
            if kind == "registered anonymous, huge pages":
                libc.madvise(self.ptr, nbytes, MADV_HUGEPAGE)
            ctypes.memset(self.ptr, 1, nbytes)
            flags = 0
        self.mapped = True
        check(cuda.cuMemHostRegister_v2(self.ptr, nbytes, flags), f"cuMemHostRegister ({kind})")
        self.registered = True

    def huge_kib(self) -> int:
        """KiB of the source backed by transparent huge pages (from /proc/self/smaps)."""
        if not self.mapped:
            return -1
        start, inside, total = f"{self.ptr:x}", False, 0
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line.split()[0] and not line.split()[0].endswith(":"):
                    inside = line.split("-")[0] == start
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
        return total

    def close(self) -> None:
        if self.registered:
            self.cuda.cuMemHostUnregister(self.ptr)
        if self.mapped:
            libc.munmap(self.ptr, self.nbytes)
        self.keep = None


class Copies:
    """Back-to-back copies of ``chunk`` bytes cycling through ``source`` on their own stream."""

    def __init__(self, source: Source, dst: torch.Tensor, chunk: int, cuda: ctypes.CDLL) -> None:
        self.source, self.dst, self.chunk, self.cuda = source, dst, chunk, cuda
        self.stream = torch.cuda.Stream(dst.device)
        self.stop = threading.Event()
        self.copied = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        torch.cuda.set_device(self.dst.device)
        at = 0
        while not self.stop.is_set():
            for _ in range(8):
                check(self.cuda.cuMemcpyHtoDAsync_v2(
                    self.dst.data_ptr(), self.source.ptr + at, self.chunk, ctypes.c_void_p(self.stream.cuda_stream)
                ), "cuMemcpyHtoDAsync")
                at = (at + self.chunk) % (self.source.nbytes - self.chunk + 1)
                self.copied += self.chunk
            self.stream.synchronize()

    def __enter__(self):
        self.t = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join()
        self.gbps = self.copied / (time.perf_counter() - self.t) / 1e9


def launches_ms(n: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Milliseconds to enqueue ``n`` small kernels, and until the GPU finished them."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        torch.add(x, 1, out=y)
    enqueued = time.perf_counter() - t
    torch.cuda.synchronize()
    return enqueued * 1e3, (time.perf_counter() - t) * 1e3


def interpreter_ms() -> float:
    t = time.perf_counter()
    d: dict = {}
    for i in range(200_000):
        d[i & 1023] = [i, i + 1]
    return (time.perf_counter() - t) * 1e3


def measure(n: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    runs = [launches_ms(n, x, y) for _ in range(5)]
    return {
        "launch_us": statistics.median(r[0] for r in runs) * 1e3 / n,
        "finished_us": statistics.median(r[1] for r in runs) * 1e3 / n,
        "interpreter_ms": statistics.median(interpreter_ms() for _ in range(5)),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    cuda = driver()
    dev = torch.device("cuda:0")
    x = torch.ones(1024, device=dev)
    y = torch.empty_like(x)
    chunk = a.chunk_mib << 20
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    nbytes = int(a.gib * 2**30) // (1 << 20) << 20
    launches_ms(1000, x, y)
    base = measure(a.launches, x, y)
    print(f"no copies: launch {base['launch_us']:.2f} us, finished {base['finished_us']:.2f} us per kernel, "
          f"interpreter {base['interpreter_ms']:.2f} ms", flush=True)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print(f"transparent huge pages: {f.read().strip()}", flush=True)
    except OSError:
        pass
    for kind in ("torch pinned", "registered anonymous", "registered anonymous, huge pages", "file mapping"):
        try:
            source = Source(kind, nbytes, a.dir, cuda)
            huge = source.huge_kib()
            if huge >= 0:
                print(f"{kind}: {huge / 2**20:.2f} GiB in huge pages", flush=True)
        except (RuntimeError, OSError, ValueError) as e:
            print(f"{kind}: not measured ({e})", flush=True)
            continue
        try:
            with Copies(source, dst, chunk, cuda) as c:
                time.sleep(0.2)
                m = measure(a.launches, x, y)
            print(f"{kind}: copies {c.gbps:.1f} GB/s; launch {m['launch_us']:.2f} us ({m['launch_us'] / base['launch_us']:.2f}x), "
                  f"finished {m['finished_us']:.2f} us ({m['finished_us'] / base['finished_us']:.2f}x), "
                  f"interpreter {m['interpreter_ms']:.2f} ms ({m['interpreter_ms'] / base['interpreter_ms']:.2f}x)", flush=True)
        finally:
            source.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
