// Decodes one bf16 encoding of ddo-codec (the bytes `EncodedBf16::to_bytes` writes) in place
// on the device. Compiled to decode.ptx by `cargo xtask kernels` (NVRTC, compute_80); the
// layout constants follow `ddo_codec::Layout`.
//
// Block b decodes chunks [128 b, 128 b + 128): each thread decodes one chunk's exponents into a
// shared row, then the block combines them with the raw sign-and-mantissa bytes and writes its
// 128 * 256 bf16 elements coalesced. Every read stays inside the encoding's parts and every
// write inside the destination's `elements`, whatever the bytes hold: damaged bytes decode to
// other values, never to an access out of bounds.

#define HEADER_AND_LENGTHS 296ull // 40-byte header, then 256 code lengths
#define TABLE_ENTRIES 4096        // one per 12-bit window
#define CODE_BITS 12
#define OFFSETS (HEADER_AND_LENGTHS + 2ull * TABLE_ENTRIES)
#define CHUNK 256                 // elements per chunk
#define THREADS 128               // threads per block, one chunk each
#define ROW_WORDS (CHUNK / 4 + 1) // a row of exponents, padded against bank conflicts

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The big-endian word of the 4 bytes at `at` (4-aligned), bytes outside [lo, hi) read as zeros.
static __device__ __forceinline__ u32 word_at(const u8* __restrict__ at, const u8* lo,
                                              const u8* hi) {
    if (at >= lo && at + 4 <= hi) {
        return __byte_perm(__ldg((const u32*)at), 0, 0x0123);
    }
    u32 w = 0;
    for (int k = 0; k < 4; k++) {
        if (at + k >= lo && at + k < hi) {
            w |= (u32)__ldg(at + k) << (24 - 8 * k);
        }
    }
    return w;
}

// A table entry whose length is a code's (1 to 12 bits), else one that skips the window and
// gives exponent 0 (no code starts so): the decoding loop needs no check.
static __device__ __forceinline__ u32 valid(u32 entry) {
    return (entry >> 8) - 1u < CODE_BITS ? entry : CODE_BITS << 8;
}

// Two elements' bf16 from their exponents (bytes 0 and 1 of `e`) and raw bytes (of `r`).
static __device__ __forceinline__ u32 pair(u32 e, u32 r) {
    u32 ee = __byte_perm(e, 0, 0x4140);
    u32 rr = __byte_perm(r, 0, 0x4140);
    return ((rr & 0x00800080u) << 8) | (ee << 7) | (rr & 0x007f007fu);
}

static __device__ __forceinline__ u16 one(u32 e, u32 r) {
    return (u16)(((r & 0x80u) << 8) | ((e & 0xffu) << 7) | (r & 0x7fu));
}

// Stores 8 elements at `out` (aligned as `align`, the low 4 bits of the destination) from their
// exponents (`e0`, `e1`) and raw bytes (at `raw`, 4-byte aligned).
static __device__ __forceinline__ void store8(u16* __restrict__ out, u32 e0, u32 e1,
                                              const u32* __restrict__ raw, u32 align) {
    const u32 r0 = __ldg(raw);
    const u32 r1 = __ldg(raw + 1);
    const u32 v0 = pair(e0, r0);
    const u32 v1 = pair(e0 >> 16, r0 >> 16);
    const u32 v2 = pair(e1, r1);
    const u32 v3 = pair(e1 >> 16, r1 >> 16);
    if (align == 0) {
        *(uint4*)out = make_uint4(v0, v1, v2, v3);
    } else if ((align & 7) == 0) {
        ((uint2*)out)[0] = make_uint2(v0, v1);
        ((uint2*)out)[1] = make_uint2(v2, v3);
    } else if ((align & 3) == 0) {
        ((u32*)out)[0] = v0;
        ((u32*)out)[1] = v1;
        ((u32*)out)[2] = v2;
        ((u32*)out)[3] = v3;
    } else {
        const u32 v[4] = {v0, v1, v2, v3};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            out[2 * k] = (u16)v[k];
            out[2 * k + 1] = (u16)(v[k] >> 16);
        }
    }
}

// `blob`: the encoding, 4-byte aligned; `dst`: `elements` bf16 (2-byte aligned); `coded_bytes`:
// the bytes of the encoding past its raw bytes (the coded exponents' real extent).
extern "C" __global__ void __launch_bounds__(THREADS)
    ddo_decode_bf16(const u8* __restrict__ blob, u16* __restrict__ dst, u64 elements,
                    u64 coded_bytes) {
    __shared__ u16 table[TABLE_ENTRIES];
    __shared__ u32 rows[THREADS * ROW_WORDS];

    const u64 chunks = (elements + CHUNK - 1) / CHUNK;
    const u32* offsets = (const u32*)(blob + OFFSETS);
    const u8* raw = blob + OFFSETS + 4 * (chunks + 1);
    const u8* coded = raw + elements;
    const u32 t = threadIdx.x;

    const u32* table_words = (const u32*)(blob + HEADER_AND_LENGTHS);
    for (u32 i = t; i < TABLE_ENTRIES / 2; i += THREADS) {
        const u32 w = __ldg(table_words + i);
        ((u32*)table)[i] = valid(w & 0xffffu) | valid(w >> 16) << 16;
    }
    __syncthreads();

    const u64 chunk = (u64)blockIdx.x * THREADS + t;
    if (chunk < chunks) {
        u64 start = __ldg(offsets + chunk);
        u64 end = __ldg(offsets + chunk + 1);
        end = end < coded_bytes ? end : coded_bytes;
        start = start < end ? start : end;
        const u8* lo = coded + start;
        const u8* hi = coded + end;
        // The bits ahead, most significant first; `bits` of them are the stream's (past its end
        // the stream reads zeros), the rest are zero.
        const u8* at = (const u8*)((u64)lo & ~3ull);
        const u32 skip = 8 * (u32)(lo - at);
        u64 buf = ((u64)word_at(at, lo, hi) << 32) << skip;
        int bits = 32 - (int)skip;
        u32 next = word_at(at + 4, lo, hi);
        at += 8;
        u64 left = elements - chunk * CHUNK;
        const u32 n = left < CHUNK ? (u32)left : CHUNK;
        u32* row = rows + t * ROW_WORDS;
        for (u32 i = 0; i < n; i += 4) {
            u32 packed = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                // 2 codes take at most 24 bits: keep at least that many ahead.
                if ((k & 1) == 0 && bits <= 32) {
                    buf |= (u64)next << (32 - bits);
                    bits += 32;
                    next = word_at(at, lo, hi);
                    at += 4;
                }
                const u32 entry = table[(u32)(buf >> 32) >> (32 - CODE_BITS)];
                const u32 len = entry >> 8;
                buf <<= len;
                bits -= (int)len;
                packed |= (entry & 0xffu) << (8 * k);
            }
            row[i / 4] = packed;
        }
    }
    __syncthreads();

    // Each thread writes 8 elements per step, a warp one chunk's row: a full block without
    // bounds checks, the last one element by element at its end.
    const u64 first = (u64)blockIdx.x * THREADS * CHUNK;
    const u32 align = (u32)((u64)dst & 15);
    if (first + THREADS * CHUNK <= elements) {
#pragma unroll 8
        for (u32 local = 8 * t; local < THREADS * CHUNK; local += 8 * THREADS) {
            const u32* x = rows + (local / CHUNK) * ROW_WORDS + (local % CHUNK) / 4;
            store8(dst + first + local, x[0], x[1], (const u32*)(raw + first + local), align);
        }
        return;
    }
#pragma unroll 1
    for (u32 local = 8 * t; local < THREADS * CHUNK; local += 8 * THREADS) {
        const u64 e = first + local;
        if (e >= elements) {
            break;
        }
        const u32* x = rows + (local / CHUNK) * ROW_WORDS + (local % CHUNK) / 4;
        if (e + 8 <= elements) {
            store8(dst + e, x[0], x[1], (const u32*)(raw + e), align);
        } else {
            const u32 m = (u32)(elements - e);
#pragma unroll 1
            for (u32 k = 0; k < m; k++) {
                dst[e + k] = one((k < 4 ? x[0] : x[1]) >> (8 * (k & 3)), __ldg(raw + e + k));
            }
        }
    }
}
