//! Where each element of a quantized tensor finds its scale ([`ScaleMap`]), over the scale values a batch
//! keeps ([`ScaleValues`]: `f32`, or MXFP4's e8m0 bytes) of one window of the scale grid ([`CellWindow`]).

use super::*;

/// Where each element of a quantized tensor finds its scale: the tensor's storage shape, the block shape
/// (ragged last blocks allowed) and the scale grid's row-major strides (`ceil(shape / block)`), over the
/// scale values already decoded to `f32` of one [`CellWindow`] of the grid (the cells a batch's items touch;
/// the whole grid in the tests). The cell indices it hands out ([`ScaleMap::locate`], [`ScaleMap::row_steps`])
/// index `values`, the window's cells row by row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScaleMap<'a> {
    pub values: ScaleValues<'a>,
    pub ndim: usize,
    pub shape: [u64; MAX_NDIM],
    pub block: [u64; MAX_NDIM],
    pub grid_strides: [u64; MAX_NDIM],
    pub window: CellWindow,
}

/// A window's scale values as a batch keeps them: decoded to `f32`, or, for the e8m0 bytes of MXFP4 scales
/// (`U8` / `F8_E8M0`), the bytes themselves, a quarter of the memory (a 1 GiB batch of gpt-oss experts holds
/// 64 MiB of them: 256 MiB as `f32`), each decoded where it is read ([`mxfp4_scale_to_f32`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ScaleValues<'a> {
    F32(&'a [f32]),
    E8m0(&'a [u8]),
}

impl ScaleValues<'_> {
    /// Value `i`.
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            ScaleValues::F32(v) => v[i],
            ScaleValues::E8m0(b) => mxfp4_scale_to_f32(b[i]),
        }
    }
}

/// Scale values read one by one in a kernel's loop (monomorphized per kind of [`ScaleValues`], so that the
/// loop holds no match).
pub(crate) trait Scales: Copy {
    /// Value `i`.
    fn scale(self, i: usize) -> f32;
}

impl Scales for &[f32] {
    #[inline(always)]
    fn scale(self, i: usize) -> f32 {
        self[i]
    }
}

/// The part of a scale grid whose values a [`ScaleMap`] holds: grid rows `row0..` (a grid row: one cell of
/// every dim but the last, `gcols` cells of the last) and, of each, the `width` cells of the last dim from
/// `col0`, stored row after row. A window as wide as the grid (`col0 = 0`, `width = gcols`) is a contiguous
/// range of the flat grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CellWindow {
    pub row0: u64,
    pub col0: u64,
    pub width: u64,
    /// Cells of the grid's last dim (1 for a 0-dim grid).
    pub gcols: u64,
}

impl CellWindow {
    /// The whole grid of `cells` cells whose last dim has `gcols` cells.
    pub(crate) fn whole(gcols: u64) -> Self {
        CellWindow {
            row0: 0,
            col0: 0,
            width: gcols,
            gcols,
        }
    }

    /// The window's index of flat grid cell `idx`; `usize::MAX` (which no `values` holds: the lookup then
    /// fails its bounds check) for a cell outside the window, which the validated items never touch.
    #[inline]
    pub(crate) fn index(&self, idx: u64) -> usize {
        let (row, col) = (idx / self.gcols, idx % self.gcols);
        match (row.checked_sub(self.row0), col.checked_sub(self.col0)) {
            (Some(r), Some(c)) if c < self.width => (r * self.width + c) as usize,
            _ => usize::MAX,
        }
    }
}

impl<'a> ScaleMap<'a> {
    /// A map over the whole grid (`values` holds every cell, row-major).
    #[cfg(test)]
    pub(crate) fn whole(
        values: &'a [f32],
        ndim: usize,
        shape: [u64; MAX_NDIM],
        block: [u64; MAX_NDIM],
        grid_strides: [u64; MAX_NDIM],
    ) -> Self {
        let gcols = match ndim {
            0 => 1,
            n => shape[n - 1].div_ceil(block[n - 1]),
        };
        ScaleMap {
            values: ScaleValues::F32(values),
            ndim,
            shape,
            block,
            grid_strides,
            window: CellWindow::whole(gcols),
        }
    }
}

impl ScaleMap<'_> {
    /// The scale of flat element `flat`, and the first flat index past `flat` whose scale may differ (the
    /// end of its block along the last dim): every index in between shares the block.
    #[inline]
    pub(crate) fn at(&self, flat: u64) -> (f32, u64) {
        let (mut rem, mut idx, mut last) = (flat, 0u64, 0u64);
        for d in (0..self.ndim).rev() {
            let c = rem % self.shape[d];
            rem /= self.shape[d];
            idx += c / self.block[d] * self.grid_strides[d];
            if d + 1 == self.ndim {
                last = c;
            }
        }
        let until = match self.ndim {
            0 => u64::MAX,
            n => {
                let b = self.block[n - 1];
                flat + ((last / b + 1) * b).min(self.shape[n - 1]) - last
            }
        };
        (self.values.get(self.window.index(idx)), until)
    }

    /// The cell of flat element `flat` (an index of `values`), the end of its block segment (as
    /// [`ScaleMap::at`]) and the end of its row of the last dim (`u64::MAX` for a 0-dim tensor); the next
    /// segment of the row is cell + 1.
    #[inline]
    pub(crate) fn locate(&self, flat: u64) -> (usize, u64, u64) {
        let (mut rem, mut idx, mut last) = (flat, 0u64, 0u64);
        for d in (0..self.ndim).rev() {
            let c = rem % self.shape[d];
            rem /= self.shape[d];
            idx += c / self.block[d] * self.grid_strides[d];
            if d + 1 == self.ndim {
                last = c;
            }
        }
        match self.ndim {
            0 => (self.window.index(0), u64::MAX, u64::MAX),
            n => {
                let (b, len) = (self.block[n - 1], self.shape[n - 1]);
                let row_end = flat - last + len;
                (
                    self.window.index(idx),
                    flat + ((last / b + 1) * b).min(len) - last,
                    row_end,
                )
            }
        }
    }
}

impl ScaleMap<'_> {
    /// For elements `flat0 + i * step` that each move whole rows of the last dim (`step` a multiple of its
    /// length) over a grid whose blocks are 1 along every other dim: the cell of the first and the cell
    /// step between consecutive elements (each element's cell is then `cell0 + i * cell_step`: each row of
    /// the tensor is a grid row, a window's row is `width` cells).
    pub(crate) fn row_steps(&self, flat0: u64, step: u64) -> Option<(usize, usize)> {
        let n = self.ndim;
        if n < 2
            || self.block[..n - 1].iter().any(|&b| b != 1)
            || !step.is_multiple_of(self.shape[n - 1])
        {
            return None;
        }
        let rows = step / self.shape[n - 1];
        let cell_step = usize::try_from(rows * self.window.width).ok()?;
        Some((self.locate(flat0).0, cell_step))
    }
}
