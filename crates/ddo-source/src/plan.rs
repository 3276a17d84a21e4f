//! Read planning: a batch of tensor reads becomes runs of file-contiguous pieces, each run at
//! most `chunk` bytes, so adjacent tensors coalesce into large reads and large tensors split
//! across workers.

use ddo_core::{ReadRequest, SourceError, TensorSlice};

/// A piece of a run: `len` bytes at `file_offset` land at `dst_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) file_offset: u64,
    pub(crate) dst_offset: usize,
    pub(crate) len: usize,
}

/// One read: contiguous bytes of one file, scattered into pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) pieces: Vec<Piece>,
}

/// Plans `requests` over `slices` into runs of at most `chunk` bytes. Checks that destinations
/// stay inside a buffer of `dst_len` bytes and do not overlap.
pub(crate) fn plan(
    slices: &[TensorSlice],
    requests: &[ReadRequest],
    dst_len: usize,
    chunk: usize,
) -> Result<Vec<Run>, SourceError> {
    let chunk = chunk.max(1);
    let mut pieces: Vec<(usize, Piece)> = Vec::with_capacity(requests.len());
    for r in requests {
        let s = slices
            .get(r.slice)
            .ok_or(SourceError::NoSuchTensor { index: r.slice, count: slices.len() })?;
        let dst_offset = usize::try_from(r.dst_offset).ok();
        let len = usize::try_from(s.len).ok();
        let fits =
            dst_offset.zip(len).and_then(|(o, l)| o.checked_add(l)).is_some_and(|e| e <= dst_len);
        if !fits {
            return Err(SourceError::InvalidBatch(format!(
                "tensor {:?} ({} bytes) at offset {} does not fit a {dst_len}-byte buffer",
                s.name, s.len, r.dst_offset
            )));
        }
        let (dst_offset, len) = (dst_offset.unwrap_or(0), len.unwrap_or(0));
        pieces.push((s.file.0 as usize, Piece { file_offset: s.offset, dst_offset, len }));
    }
    let mut by_dst: Vec<&Piece> = pieces.iter().map(|(_, p)| p).filter(|p| p.len > 0).collect();
    by_dst.sort_by_key(|p| p.dst_offset);
    if let Some(w) = by_dst.windows(2).find(|w| w[0].dst_offset + w[0].len > w[1].dst_offset) {
        return Err(SourceError::InvalidBatch(format!(
            "destinations overlap at offsets {} and {}",
            w[0].dst_offset, w[1].dst_offset
        )));
    }

    pieces.sort_by_key(|(file, p)| (*file, p.file_offset));
    let mut runs: Vec<Run> = Vec::new();
    for (file, mut piece) in pieces.into_iter().filter(|(_, p)| p.len > 0) {
        while piece.len > 0 {
            let extend = runs.last().is_some_and(|r| {
                r.file == file && r.offset + r.len as u64 == piece.file_offset && r.len < chunk
            });
            if !extend {
                runs.push(Run { file, offset: piece.file_offset, len: 0, pieces: Vec::new() });
            }
            let run = runs.last_mut().expect("a run");
            let take = piece.len.min(chunk - run.len);
            run.pieces.push(Piece { len: take, ..piece });
            run.len += take;
            piece.file_offset += take as u64;
            piece.dst_offset += take;
            piece.len -= take;
        }
    }
    Ok(runs)
}

/// Splits `dst` into the disjoint destination slices of each run's pieces (validated by
/// [`plan`]), in run order.
pub(crate) fn carve<'a>(runs: &[Run], dst: &'a mut [u8]) -> Vec<Vec<&'a mut [u8]>> {
    let mut order: Vec<(usize, usize, Piece)> = runs
        .iter()
        .enumerate()
        .flat_map(|(ri, r)| r.pieces.iter().enumerate().map(move |(pi, p)| (ri, pi, *p)))
        .collect();
    order.sort_by_key(|(_, _, p)| p.dst_offset);
    let mut out: Vec<Vec<Option<&'a mut [u8]>>> =
        runs.iter().map(|r| (0..r.pieces.len()).map(|_| None).collect()).collect();
    let mut rest = dst;
    let mut consumed = 0usize;
    for (ri, pi, p) in order {
        let (_, tail) = rest.split_at_mut(p.dst_offset - consumed);
        let (piece, tail) = tail.split_at_mut(p.len);
        out[ri][pi] = Some(piece);
        rest = tail;
        consumed = p.dst_offset + p.len;
    }
    out.into_iter()
        .map(|r| r.into_iter().map(|p| p.expect("every piece carved")).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::{CheckpointFileId, Dtype};

    fn slice(file: u32, offset: u64, len: u64) -> TensorSlice {
        TensorSlice {
            name: format!("t{offset}"),
            dtype: Dtype::U8,
            shape: vec![len],
            file: CheckpointFileId(file),
            path: "f".into(),
            offset,
            len,
        }
    }

    #[test]
    fn adjacent_tensors_coalesce_and_large_ones_split() {
        let slices = [slice(0, 100, 10), slice(0, 110, 30), slice(0, 200, 5), slice(1, 110, 5)];
        let req = |slice, dst_offset| ReadRequest { slice, dst_offset };
        let runs =
            plan(&slices, &[req(1, 64), req(0, 0), req(2, 16), req(3, 32)], 128, 16).unwrap();
        let shape: Vec<(usize, u64, usize)> =
            runs.iter().map(|r| (r.file, r.offset, r.len)).collect();
        assert_eq!(shape, [(0, 100, 16), (0, 116, 16), (0, 132, 8), (0, 200, 5), (1, 110, 5)]);
        assert_eq!(runs[0].pieces.len(), 2);
        assert_eq!(runs[0].pieces[1], Piece { file_offset: 110, dst_offset: 64, len: 6 });
        let mut dst = vec![0u8; 128];
        let carved = carve(&runs, &mut dst);
        assert_eq!(
            carved.iter().map(|r| r.iter().map(|p| p.len()).sum::<usize>()).collect::<Vec<_>>(),
            [16, 16, 8, 5, 5]
        );
    }

    #[test]
    fn bad_batches_are_refused() {
        let slices = [slice(0, 0, 10), slice(0, 10, 10)];
        let req = |slice, dst_offset| ReadRequest { slice, dst_offset };
        assert!(
            plan(&slices, &[req(0, 0), req(1, 5)], 64, 8)
                .unwrap_err()
                .to_string()
                .contains("overlap")
        );
        assert!(
            plan(&slices, &[req(0, 60)], 64, 8).unwrap_err().to_string().contains("does not fit")
        );
        assert!(plan(&slices, &[req(0, u64::MAX)], 64, 8).is_err());
        assert!(matches!(
            plan(&slices, &[req(5, 0)], 64, 8),
            Err(SourceError::NoSuchTensor { .. })
        ));
    }
}
