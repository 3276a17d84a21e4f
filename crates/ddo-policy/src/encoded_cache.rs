//! The encoded-file folder `vmm_weight_encoding` uses when `vmm_encoded_cache_dir` is empty,
//! and how it is kept bounded: pure rules over values the composition root reads.

use std::path::PathBuf;

/// The most bytes of encoded files the default folder keeps: beyond it, the least recently
/// used files are removed ([`lru_evictions`]).
pub const DEFAULT_ENCODED_CACHE_BYTES: u64 = 64 << 30;

/// ddo's cache folder, from the environment `var` reads: `$DDO_CACHE_DIR` when set; else
/// beside the Hugging Face cache, `$HF_HOME/ddo`; else `$XDG_CACHE_HOME/huggingface/ddo`; else
/// `$HOME/.cache/huggingface/ddo`. `None` when none of them is set. Empty values count as
/// unset. It holds the encoded files (`encoded/`) and the machine profile (`machine.json`).
pub fn ddo_cache_dir(var: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("DDO_CACHE_DIR") {
        return Some(dir);
    }
    let hf = set("HF_HOME")
        .or_else(|| set("XDG_CACHE_HOME").map(|c| c.join("huggingface")))
        .or_else(|| set("HOME").map(|h| h.join(".cache").join("huggingface")))?;
    Some(hf.join("ddo"))
}

/// The default encoded-file folder: `encoded` in [`ddo_cache_dir`] (`None` without one: no
/// folder, encodings are made at load and not kept).
pub fn default_encoded_cache_dir(var: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    ddo_cache_dir(var).map(|d| d.join("encoded"))
}

/// A file of a bounded folder: its bytes and when it was last used (any monotone clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheEntry {
    /// Bytes.
    pub bytes: u64,
    /// When last used.
    pub last_used: u128,
}

/// Which of `entries` to remove so that the rest hold at most `cap` bytes: the least recently
/// used first (ties: the larger first), never `keep` (the file just written or used), even when
/// it alone is over `cap`. Indices into `entries`, in removal order.
pub fn lru_evictions(entries: &[CacheEntry], cap: u64, keep: Option<usize>) -> Vec<usize> {
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    let mut order: Vec<usize> = (0..entries.len()).filter(|&i| Some(i) != keep).collect();
    order.sort_by_key(|&i| (entries[i].last_used, std::cmp::Reverse(entries[i].bytes)));
    let mut out = Vec::new();
    for i in order {
        if total <= cap {
            break;
        }
        total -= entries[i].bytes;
        out.push(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_default_folder_is_ddo_cache_dir_else_beside_the_hugging_face_cache() {
        let all = [
            ("DDO_CACHE_DIR", "/d"),
            ("HF_HOME", "/hf"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
        ];
        let dir = |from: usize| default_encoded_cache_dir(env(&all[from..]));
        assert_eq!(dir(0), Some(PathBuf::from("/d/encoded")));
        assert_eq!(ddo_cache_dir(env(&all)), Some(PathBuf::from("/d")));
        assert_eq!(ddo_cache_dir(env(&all[1..])), Some(PathBuf::from("/hf/ddo")));
        assert_eq!(dir(1), Some(PathBuf::from("/hf/ddo/encoded")));
        assert_eq!(dir(2), Some(PathBuf::from("/xdg/huggingface/ddo/encoded")));
        assert_eq!(dir(3), Some(PathBuf::from("/home/u/.cache/huggingface/ddo/encoded")));
        assert_eq!(dir(4), None);
        // An empty value is unset.
        let empty = [("DDO_CACHE_DIR", ""), ("HF_HOME", ""), ("HOME", "/h")];
        assert_eq!(
            default_encoded_cache_dir(env(&empty)),
            Some(PathBuf::from("/h/.cache/huggingface/ddo/encoded"))
        );
    }

    #[test]
    fn the_least_recently_used_files_go_until_the_rest_fit() {
        let e = |bytes, last_used| CacheEntry { bytes, last_used };
        let entries = [e(40, 3), e(30, 1), e(20, 2), e(50, 4)];
        // 140 bytes: 30 (used first) then 20 go for a cap of 100.
        assert_eq!(lru_evictions(&entries, 100, None), vec![1, 2]);
        assert_eq!(lru_evictions(&entries, 140, None), Vec::<usize>::new());
        // The kept file stays even when older than the rest.
        assert_eq!(lru_evictions(&entries, 100, Some(1)), vec![2, 0]);
        // One file over the cap alone: everything else goes, it stays.
        assert_eq!(lru_evictions(&entries, 10, Some(3)), vec![1, 2, 0]);
        assert_eq!(lru_evictions(&[], 0, None), Vec::<usize>::new());
    }
}
