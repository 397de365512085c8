//! A scale record checked against the tensor it scales (index, dims, grid size, dtype) before anything is
//! read.

use super::*;

/// Validates scale `k` against its tensor (index, dims, grid size, dtype) without reading it.
pub(in crate::exec) fn check_scale(
    k: usize,
    s: &Scale,
    files: &[Arc<Header>],
) -> Result<LoadedScale, LoadError> {
    let bad = |reason: String| LoadError::request(format!("scale {k}: {reason}"));
    let file = usize::try_from(s.file)
        .ok()
        .filter(|&f| f < files.len())
        .ok_or_else(|| bad(format!("file index {} is out of range", s.file)))?;
    let h = &files[file];
    let tensor = usize::try_from(s.tensor)
        .ok()
        .filter(|&t| t < h.tensors.len())
        .ok_or_else(|| bad(format!("tensor index {} is out of range", s.tensor)))?;
    let t = &h.tensors[tensor];
    let ndim = usize::try_from(s.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| bad(format!("ndim {} is outside 0..={MAX_NDIM}", s.ndim)))?;
    let (mut shape, mut block, mut grid_strides) =
        ([1u64; MAX_NDIM], [1u64; MAX_NDIM], [0u64; MAX_NDIM]);
    let mut cells: u64 = 1;
    for d in (0..ndim).rev() {
        if s.shape[d] < 1 || s.block[d] < 1 {
            return Err(bad(format!(
                "dim {d}: shape {} and block {} must be positive",
                s.shape[d], s.block[d]
            )));
        }
        shape[d] = s.shape[d] as u64;
        block[d] = s.block[d] as u64;
        grid_strides[d] = cells;
        cells = cells.saturating_mul(shape[d].div_ceil(block[d]));
    }
    if cells != t.numel() {
        return Err(bad(format!(
            "'{}' has {} elements (shape {:?}) but a grid of blocks {:?} over shape {:?} has {cells}",
            t.name,
            t.numel(),
            t.shape,
            &block[..ndim],
            &shape[..ndim]
        )));
    }
    if !is_scale_dtype(t.dtype) {
        return Err(bad(format!(
            "'{}' is {}; scales must be F32, BF16, F16, F8_E8M0 or U8 (e8m0)",
            t.name, t.dtype
        )));
    }
    Ok(LoadedScale {
        values: Kept::F32(Vec::new()),
        window: CellWindow::whole(1),
        ndim,
        shape,
        block,
        grid_strides,
        cells,
        file,
        tensor,
        bytes: 0,
        mxfp4: false,
    })
}
