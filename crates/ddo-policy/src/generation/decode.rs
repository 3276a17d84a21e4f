//! Whether the VAE's decode fits the card at the resolution asked, decided before the denoise
//! starts: a decode that does not fit must never fail after the steps' time is spent.

use serde::{Deserialize, Serialize};

use super::choose::gib;

/// How the decode may run when its working set does not fit the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VaeDecode {
    /// As the pipeline runs it, whole: a decode that cannot fit is refused before the denoise.
    Exact,
    /// Diffusers' tiled decode when the whole one does not fit (the output changes: tiles are
    /// blended at their seams).
    Tiled,
    /// Diffusers' sliced decode (one image of the batch at a time; the output is unchanged for
    /// a batch of one, which it does not shrink).
    Sliced,
}

impl VaeDecode {
    /// The setting's value by name.
    pub fn parse(name: &str) -> Option<VaeDecode> {
        match name {
            "exact" => Some(VaeDecode::Exact),
            "tiled" => Some(VaeDecode::Tiled),
            "sliced" => Some(VaeDecode::Sliced),
            _ => None,
        }
    }
}

/// The decode's peak working set at `pixels` output pixels per frame, from two measured
/// one-frame decodes: a line through them (activations grow with the pixels; what does not is
/// the intercept), with an eighth more for the allocator's rounding. A video VAE decodes frame
/// by frame, and its output of `frames` frames of `bytes_per_pixel` each adds to that.
pub fn decode_need_bytes(
    small: (u64, u64),
    large: (u64, u64),
    pixels: u64,
    frames: u64,
    bytes_per_pixel: u64,
) -> u64 {
    let ((p0, b0), (p1, b1)) = if small.0 <= large.0 { (small, large) } else { (large, small) };
    let slope = if p1 > p0 { b1.saturating_sub(b0) as f64 / (p1 - p0) as f64 } else { 0.0 };
    let need = b1 as f64 + slope * pixels.saturating_sub(p1) as f64;
    let need = need.max(b1 as f64) * 1.125;
    let output = frames.saturating_sub(1) as f64 * pixels as f64 * bytes_per_pixel as f64;
    (need + output).min(u64::MAX as f64) as u64
}

/// What the decode will do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum DecodeFit {
    /// The whole decode fits.
    Fits {
        /// Its working set.
        need_bytes: u64,
        /// What the card can give it.
        available_bytes: u64,
    },
    /// It does not fit; the setting allows Diffusers' tiled or sliced decode.
    Reduced {
        /// The mode turned on.
        mode: VaeDecode,
        /// The whole decode's working set.
        need_bytes: u64,
        /// What the card can give it.
        available_bytes: u64,
        /// What the user is told.
        message: String,
    },
    /// It does not fit and the setting keeps the decode whole: refused before the denoise.
    Refused {
        /// What to change.
        message: String,
    },
}

/// Whether a decode of `need_bytes` fits `available_bytes` (free now plus what idle arenas can
/// give back), for an output `size` the user reads (`1024x1024`).
pub fn decode_fit(
    need_bytes: u64,
    available_bytes: u64,
    setting: VaeDecode,
    size: &str,
) -> DecodeFit {
    if need_bytes <= available_bytes {
        return DecodeFit::Fits { need_bytes, available_bytes };
    }
    let short = format!(
        "the VAE decode at {size} needs about {} and the card can give it {} with every idle arena shrunk",
        gib(need_bytes),
        gib(available_bytes)
    );
    match setting {
        VaeDecode::Exact => DecodeFit::Refused {
            message: format!(
                "{short}: pass vae_decode=\"tiled\" (Diffusers' tiled decode, which blends tiles at their seams and so \
                 changes the output), or a smaller size, or free GPU memory"
            ),
        },
        mode => DecodeFit::Reduced {
            mode,
            need_bytes,
            available_bytes,
            message: format!(
                "{short}: the VAE decodes {} (vae_decode={mode:?})",
                match mode {
                    VaeDecode::Tiled =>
                        "in tiles; the output differs from a whole decode at the tiles' seams",
                    _ => "one image at a time",
                }
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_need_grows_with_the_pixels_through_both_measurements() {
        // 100 MiB of weights and workspace, 1 KiB per pixel.
        let at = |p: u64| 100 * MIB + p * 1024;
        let need = decode_need_bytes((4096, at(4096)), (16384, at(16384)), 1 << 20, 1, 6);
        let exact = at(1 << 20);
        assert!(need >= exact && need <= exact * 9 / 8 + 1, "{need} vs {exact}");
        // The order of the measurements does not matter.
        assert_eq!(need, decode_need_bytes((16384, at(16384)), (4096, at(4096)), 1 << 20, 1, 6));
        // More frames add their output, not another frame's activations.
        let video = decode_need_bytes((4096, at(4096)), (16384, at(16384)), 1 << 20, 5, 6);
        assert_eq!(video - need, 4 * (1 << 20) * 6);
    }

    #[test]
    fn a_decode_that_does_not_fit_is_refused_or_reduced_as_set() {
        assert!(matches!(decode_fit(10, 10, VaeDecode::Exact, "8x8"), DecodeFit::Fits { .. }));
        let DecodeFit::Refused { message } = decode_fit(11, 10, VaeDecode::Exact, "8x8") else {
            panic!()
        };
        assert!(message.contains("vae_decode=\"tiled\""), "{message}");
        assert!(matches!(
            decode_fit(11, 10, VaeDecode::Tiled, "8x8"),
            DecodeFit::Reduced { mode: VaeDecode::Tiled, .. }
        ));
    }
}
