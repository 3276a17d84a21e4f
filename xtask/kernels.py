"""Compiles a CUDA C kernel to PTX with NVRTC, from the nvidia-cuda-nvrtc wheel (no toolkit).

Usage: python3 kernels.py WHEEL SOURCE.cu OUT.ptx [--check]

The PTX's first line records the SHA-256 of the source, so a test can tell that the committed
PTX was compiled from the committed source. With --check nothing is written: the exit status
says whether OUT.ptx is what SOURCE.cu compiles to.
"""

import ctypes
import hashlib
import os
import sys
import tempfile
import zipfile

OPTIONS = [b"--gpu-architecture=compute_80"]
LIBS = ("libnvrtc-builtins.so.12.0", "libnvrtc.so.12")


def load_nvrtc(wheel, into):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if os.path.basename(name) in LIBS:
                path = os.path.join(into, os.path.basename(name))
                with open(path, "wb") as f:
                    f.write(z.read(name))
    # NVRTC opens its builtins library by name: load it first, globally.
    ctypes.CDLL(os.path.join(into, LIBS[0]), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(into, LIBS[1]))


def compile_ptx(nvrtc, source, name):
    def check(result, what):
        if result != 0:
            nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
            sys.exit(f"{what}: {nvrtc.nvrtcGetErrorString(result).decode()}")

    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None),
          "nvrtcCreateProgram")
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    compiled = nvrtc.nvrtcCompileProgram(prog, len(OPTIONS), options)
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
    log = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    check(compiled, f"compiling {name}")
    check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def main():
    args = [a for a in sys.argv[1:] if a != "--check"]
    if len(args) != 3:
        sys.exit(__doc__)
    wheel, source_path, out = args
    with open(source_path, "rb") as f:
        source = f.read()
    name = os.path.basename(source_path)
    with tempfile.TemporaryDirectory() as libs:
        ptx = compile_ptx(load_nvrtc(wheel, libs), source, name)
    digest = hashlib.sha256(source).hexdigest()
    text = f"// ddo: {name} sha256 {digest}, compiled by `cargo xtask kernels`\n{ptx}"
    if "--check" in sys.argv[1:]:
        with open(out) as f:
            same = f.read() == text
        print(f"{out} {'matches' if same else 'differs from'} {name}")
        sys.exit(0 if same else 1)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out} ({len(text)} bytes) from {name}")


if __name__ == "__main__":
    main()
