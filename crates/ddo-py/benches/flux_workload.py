"""The reference workload shared by the GPU scripts: a Flux-style transformer with random bf16
weights (built on meta, then filled, so no float32 copy is made), its inputs, and the pinned copy
speed that defines the floor, and the disk's cold read speed beside it."""

from __future__ import annotations

import json
import mmap
import os
import threading
import time

import torch


def random_model(cls, dtype=torch.bfloat16, **config):
    """``cls(**config)`` in ``dtype`` with N(0, 0.02) weights, on the CPU, in eval mode. The
    values are drawn on the GPU when there is one (drawing billions on the CPU takes minutes)."""
    torch.set_default_dtype(dtype)
    with torch.device("meta"):
        model = cls(**config)
    torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cpu").eval()
    draw = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(draw).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device=draw).mul_(0.02).to(p.dtype))
    return model


def saved_model(work: str, name: str, cls, label: str, save_dtype=None, **config) -> tuple[str, int]:
    """``cls(**config)`` with random weights saved under ``work/name`` (built once and reused
    while the folder lives), in ``save_dtype`` when given; returns its folder and its parameter
    bytes in bf16."""
    path = os.path.join(work, name)
    marker = os.path.join(path, "ddo-built.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return path, json.load(f)["bytes"]
    t = time.perf_counter()
    # An fp32 file is built in fp32 (no bf16 copy beside it); fp8 from bf16.
    model = random_model(cls, dtype=torch.float32 if save_dtype == torch.float32 else torch.bfloat16, **config)
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    if save_dtype is not None:
        model = model.to(save_dtype)
    model.save_pretrained(path)
    del model
    with open(marker, "w") as f:
        json.dump({"bytes": nbytes, "parameters": params}, f)
    print(f"built and saved a {label} model: {params / 1e9:.2f} B parameters ({nbytes / 2**30:.2f} GiB) "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    return path, nbytes


def saved_flux(work: str, double: int, single: int, save_dtype=None) -> tuple[str, int]:
    """A Flux-style model with ``double`` + ``single`` blocks saved under ``work`` (in
    ``save_dtype`` when given: ``torch.float8_e4m3fn`` for an fp8 checkpoint)."""
    from diffusers import FluxTransformer2DModel

    suffix = "" if save_dtype is None else "-" + str(save_dtype).removeprefix("torch.")
    return saved_model(work, f"flux-{double}-{single}{suffix}", FluxTransformer2DModel, f"Flux-style{suffix}",
                       save_dtype=save_dtype, num_layers=double, num_single_layers=single)


def q8_0(weight: torch.Tensor):
    """GGML Q8_0 blocks of a 2-D weight, as numpy bytes [rows, row bytes]: per 32 values one f16
    scale (max |x| / 127) and 32 int8 values rounded to nearest, as llama.cpp quantizes."""
    rows = weight.shape[0]
    x = weight.to("cuda" if torch.cuda.is_available() else "cpu", torch.float32).reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d > 0, x / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return blocks.reshape(rows, -1).cpu().numpy()


def saved_flux_q8(work: str, double: int, single: int) -> tuple[str, int]:
    """A Flux-style model saved as one GGUF file with Diffusers' parameter names: every Linear
    weight in Q8_0, the rest (biases, norms) in F32; the folder also holds its config.json.
    Returns the folder and the GGUF file's tensor bytes."""
    import gguf
    from diffusers import FluxTransformer2DModel

    path = os.path.join(work, f"flux-{double}-{single}-q8_0")
    marker = os.path.join(path, "ddo-built.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return path, json.load(f)["bytes"]
    t = time.perf_counter()
    model = random_model(FluxTransformer2DModel, num_layers=double, num_single_layers=single)
    model.save_config(path)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    writer = gguf.GGUFWriter(os.path.join(path, "model-Q8_0.gguf"), arch="flux")
    nbytes = 0
    for name, p in model.state_dict().items():
        if name in linear and p.shape[-1] % 32 == 0:
            data = q8_0(p)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            data = p.float().numpy()
            writer.add_tensor(name, data)
        nbytes += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del model
    with open(marker, "w") as f:
        json.dump({"bytes": nbytes}, f)
    print(f"built and saved a Flux-style Q8_0 GGUF model ({nbytes / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s",
          flush=True)
    return path, nbytes


# SD3.5-Large-shaped SD3Transformer2DModel (8.1 B parameters, 15 GiB in bf16): the second model
# family of the benchmark, so nothing is tuned to Flux's block shapes.
SD3_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
)


def saved_sd3(work: str) -> tuple[str, int]:
    """The SD3.5-Large-shaped model saved under ``work``."""
    from diffusers import SD3Transformer2DModel

    return saved_model(work, "sd3-large", SD3Transformer2DModel, "SD3-style", **SD3_LARGE)


# Wan-2.1-14B-shaped WanTransformer3DModel (40 blocks of 5120 wide; fewer here), saved in fp32 as
# many published checkpoints are and loaded as bf16: the third family, and the conversion row.
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)


def saved_wan(work: str, layers: int, save_dtype=torch.float32) -> tuple[str, int]:
    """The Wan-14B-shaped model with ``layers`` blocks saved under ``work`` in ``save_dtype``
    (fp32, ``wan-LAYERS-fp32``, or bf16, ``wan-LAYERS-bf16``)."""
    from diffusers import WanTransformer3DModel

    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[save_dtype]
    return saved_model(work, f"wan-{layers}-{name}", WanTransformer3DModel, f"Wan-style (saved in {name})",
                       save_dtype=save_dtype, **dict(WAN_14B, num_layers=layers))


def wan_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Three latent frames of ``resolution`` x ``resolution`` (8x VAE, 2x2 patches: 3 *
    (resolution / 16)^2 tokens) with 512 text tokens."""
    side = resolution // 8
    return dict(
        hidden_states=torch.randn(1, 16, 3, side, side, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([500]).to(device),
        return_dict=False,
    )


def sd3_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Batch 1 at ``resolution`` ((resolution / 16)^2 image tokens after 2x2 patches of the 8x
    latents) with 333 text tokens (77 CLIP + 256 T5), as SD3 pipelines use."""
    side = resolution // 8
    return dict(
        hidden_states=torch.randn(1, 16, side, side, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 333, 4096, generator=generator).to(device, torch.bfloat16),
        pooled_projections=torch.randn(1, 2048, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([500.0], dtype=torch.bfloat16).to(device),
        return_dict=False,
    )


def flux_inputs(resolution: int, device, generator: torch.Generator) -> dict:
    """Batch 1 at ``resolution`` (2x2-packed latents: (resolution / 16)^2 image tokens) with 512
    text tokens."""
    tokens = (resolution // 16) ** 2
    return dict(
        hidden_states=torch.randn(1, tokens, 64, generator=generator).to(device, torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=generator).to(device, torch.bfloat16),
        pooled_projections=torch.randn(1, 768, generator=generator).to(device, torch.bfloat16),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16).to(device),
        img_ids=torch.zeros(tokens, 3).to(device),
        txt_ids=torch.zeros(512, 3).to(device),
        return_dict=False,
    )


def link_speed(device="cuda:0") -> float:
    """Bytes per second of the best of five 1 GiB pinned host-to-device copies."""
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    target = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, (1 << 30) / (time.perf_counter() - t))
    return best


def timed(fn, steps):
    """Runs ``fn`` ``steps`` times without grad, synchronizing around each; returns the seconds of
    each run and the last output."""
    times, out = [], None
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, out


def checkpoint_files(path: str) -> list[str]:
    """The weight files of a saved model folder (safetensors shards or a GGUF file)."""
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".gguf")))


def evict_from_cache(files: list[str]) -> str:
    """Drops ``files`` from the page cache: ``sync`` and ``vm.drop_caches = 1`` where it can be
    written (root), and in any case ``fsync`` + ``POSIX_FADV_DONTNEED`` on each file. Returns how."""
    how = []
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        how.append("drop_caches")
    except OSError:
        pass
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how.append("fadvise")
    return "+".join(how)


def cached_fraction(files: list[str]) -> float | None:
    """The fraction of ``files``' pages in the page cache (mincore), or None where it cannot be
    read."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        page = os.sysconf("SC_PAGE_SIZE")
        cached = total = 0
        for name in files:
            size = os.path.getsize(name)
            if size == 0:
                continue
            fd = os.open(name, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                pages = (size + page - 1) // page
                vec = ctypes.create_string_buffer(pages)
                ok = libc.mincore(addr, size, vec) == 0
                libc.munmap(addr, size)
                if not ok:
                    return None
                cached += sum(b & 1 for b in vec.raw)
                total += pages
            finally:
                os.close(fd)
        return cached / total if total else None
    except (OSError, AttributeError):
        return None


def warm_files(files: list[str]) -> float:
    """Reads ``files`` through the page cache (so a later load finds them cached, as right after
    they were written); returns the seconds it took."""
    t = time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return time.perf_counter() - t


def disk_read_speed(path: str, threads: int = 8, request: int = 16 << 20) -> float:
    """Bytes per second of a cold read of ``path``: evicted from the page cache, then read with
    O_DIRECT in ``request``-byte reads into page-aligned buffers by ``threads`` threads taking
    the requests in file order (``threads`` in flight at once, as ddo's readers keep them)."""
    evict_from_cache([path])
    size = os.path.getsize(path)
    chunks = (size + request - 1) // request
    done = [0] * threads
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            buf = mmap.mmap(-1, request)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                for c in range(i, chunks, threads):
                    n = os.preadv(fd, [buf], c * request)
                    done[i] += n
                    if n < request:
                        break
            finally:
                os.close(fd)
                buf.close()
        except BaseException as e:  # noqa: BLE001 - raised again below
            errors.append(e)

    workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    if errors:
        raise errors[0]
    if sum(done) != size:
        raise RuntimeError(f"O_DIRECT read of {path} got {sum(done)} of {size} bytes")
    return size / seconds
