"""What copies running beside a GPU-bound workload cost its kernels, by copy size and source.

The workload is a run of SD3-Large-shaped transformer blocks at 1024x1024 (4,429 tokens of 2,432
features: norms, projections, attention, the MLP) on weights already on the GPU, enqueued far
ahead of the GPU so that nothing on the host can slow it. Beside it a second stream copies
from page-locked host memory (or device memory) in chunks of a given size, back to back. Each
row is the workload's GPU time against the row without copies, the modes taken in turn over
several rounds.

    python gpu_copy_beside.py [--blocks 38] [--rounds 7] [--workload blocks|small]

``--workload small`` runs blocks of 80 short elementwise kernels instead (``--small-mib`` sets
their length); the host enqueue column tells whether the GPU or the host set the pace.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

TOKENS, WIDTH, HEADS = 4429, 2432, 38


def block_weights(dev: torch.device, g: torch.Generator) -> dict:
    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dev, torch.bfloat16)

    return {"qkv": w(3 * WIDTH, WIDTH), "out": w(WIDTH, WIDTH), "up": w(4 * WIDTH, WIDTH), "down": w(WIDTH, 4 * WIDTH)}


def run_block(x: torch.Tensor, w: dict) -> torch.Tensor:
    h = F.layer_norm(x, (WIDTH,))
    q, k, v = F.linear(h, w["qkv"]).view(1, TOKENS, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, TOKENS, WIDTH)
    x = x + F.linear(a, w["out"])
    h = F.layer_norm(x, (WIDTH,))
    return x + F.linear(F.gelu(F.linear(h, w["up"]), approximate="tanh"), w["down"])


def run_small(x: torch.Tensor, w: dict) -> torch.Tensor:
    """Eighty elementwise kernels on ``--small-mib`` MiB (16: about 10 us each on the GPU, near
    what the host needs to launch one; the host enqueue column says which side sets the pace):
    many short kernels, as the norms, scales and gates of a real block are."""
    for _ in range(40):
        x = x * 1.0001
        x = x + 0.0001
    return x


def sleep_cycles_per_ms(dev: torch.device) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    torch.cuda.synchronize(dev)
    return 20_000_000 / s.elapsed_time(e)


def measure(mode: dict, run, weights: list, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, side: torch.cuda.Stream,
            cycles_per_ms: float) -> tuple:
    """The workload's GPU milliseconds, the copies' GB/s while the workload ran, and the host's
    milliseconds to enqueue the workload (well under the GPU's: the GPU set the pace; near it:
    the host did)."""
    torch.cuda.synchronize()
    chunk = mode.get("chunk_mib", 0) << 20
    copied = 0
    c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if chunk:
        # Enough copies to outlast the workload where the stream can hold them ("covered").
        budget = int(mode.get("cover_gb", 14) * 1e9)
        with torch.cuda.stream(mode.get("stream", side)):
            c0.record()
            offset = 0
            while copied < budget:
                if offset + chunk > src.numel():
                    offset = 0
                dst_off = (copied // chunk % 2) * chunk if mode.get("ring") else offset
                dst[dst_off:dst_off + chunk].copy_(src[offset:offset + chunk], non_blocking=True)
                offset += chunk
                copied += chunk
            c1.record()
        # The copies start first.
        torch.cuda._sleep(int(2 * cycles_per_ms))
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t = time.perf_counter()
    for w in weights:
        x = run(x, w)
    host = (time.perf_counter() - t) * 1e3
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e)
    rate = copied / (c0.elapsed_time(c1) / 1e3) / 1e9 if chunk else 0.0
    # The copies must have been running for the whole workload.
    covered = (not chunk) or (c0.elapsed_time(e) <= c0.elapsed_time(c1))
    return ms, rate, covered, host


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=38)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workload", choices=["blocks", "small"], default="blocks",
                    help="blocks: SD3-shaped blocks; small: 80 short elementwise kernels per block")
    ap.add_argument("--small-mib", type=int, default=16, help="the tensor each short kernel reads and writes")
    a = ap.parse_args()
    for name in ("blocks", "rounds", "small_mib"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be 1 or more")
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(0)
    weights = [block_weights(dev, g)] * a.blocks  # one block's weights: its kernels are what matters
    x = torch.randn(1, TOKENS, WIDTH, generator=g).to(dev, torch.bfloat16)
    run = run_block
    if a.workload == "small":
        run, x = run_small, torch.randn(a.small_mib << 19, generator=g).to(dev, torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    src_dev = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    cpm = sleep_cycles_per_ms(dev)
    modes = {"none": {}}
    for mib in (512, 256, 128, 64, 32, 16, 8, 4):
        # A stream holds about a thousand pending operations: small chunks cover less time.
        modes[f"host, {mib} MiB copies"] = {"chunk_mib": mib, "cover_gb": min(14.0, 0.9 * mib)}
    modes["host, 32 MiB copies into a ring of 64 MiB"] = {"chunk_mib": 32, "ring": True}
    # The copies' stream at the highest priority instead of the default (lowest).
    modes["host, 256 MiB copies, high-priority stream"] = {
        "chunk_mib": 256, "stream": torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1]),
    }
    modes["device, 256 MiB copies"] = {"chunk_mib": 256, "device": True, "cover_gb": 120}
    for _ in range(2):  # warm-up
        for w in weights[:4]:
            x = run(x, w)
    torch.cuda.synchronize()
    rows: dict = {m: ([], [], []) for m in modes}
    uncovered = set()
    for r in range(a.rounds):
        names = list(modes)
        for m in names[r % len(names):] + names[: r % len(names)]:
            mode = modes[m]
            d = dst[: 64 << 20] if mode.get("ring") else dst
            ms, rate, covered, host = measure(mode, run, weights, x, src_dev if mode.get("device") else src, d, side, cpm)
            rows[m][0].append(ms)
            rows[m][1].append(rate)
            rows[m][2].append(host)
            if not covered:
                uncovered.add(m)
    base = statistics.median(rows["none"][0])
    what = "SD3-Large-shaped blocks at 1024x1024" if a.workload == "blocks" else "blocks of 80 short kernels"
    print(f"\n{a.blocks} {what} on {torch.cuda.get_device_name(dev)}, {a.rounds} rounds\n")
    print("| copies beside | workload ms (median; min-max) | x without copies | copy GB/s | host enqueue ms |")
    print("|---|---|---|---|---|")
    for m, (ms, rate, host) in rows.items():
        note = " (copies ended before the workload)" if m in uncovered else ""
        print(f"| {m}{note} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) | {statistics.median(ms) / base:.3f} | "
              f"{statistics.median(rate):.1f} | {statistics.median(host):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
