//! Plain data shared by the planner, the overlap check, the destination writer and the executor: a read
//! request ([`Item`]), a planned strided copy ([`Run`], with its byte geometry) and [`MAX_NDIM`]. It builds
//! nothing and checks nothing (the planner, `crate::runs`, does); its only dependency is [`Dtype`].
//!
//! ```
//! use hp_fastload::{Item, MAX_NDIM};
//! // Rows 2..4 of a [4, 8] tensor into a contiguous [2, 8] destination.
//! let mut item = Item { ndim: 2, src_base: 16, ..Item::default() };
//! item.lengths[..2].copy_from_slice(&[2, 8]);
//! item.src_strides[..2].copy_from_slice(&[8, 1]);
//! item.dst_strides[..2].copy_from_slice(&[8, 1]);
//! assert!(item.ndim as usize <= MAX_NDIM);
//! ```

use crate::dtype::Dtype;

/// Most dimensions an item can have.
pub const MAX_NDIM: usize = 8;

/// One strided box of one tensor to copy into one destination buffer. All numbers are elements (of the
/// source dtype on the source side, of the destination dtype on the destination side); they are signed so
/// that values coming from Python can be checked rather than wrapped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Item {
    /// Index into the `files` given to [`crate::execute`].
    pub file: i64,
    /// Index into that file's [`crate::Header::tensors`].
    pub tensor: i64,
    /// Element index in the tensor of the box's first element.
    pub src_base: i64,
    /// Index into the destination buffers.
    pub dest: i64,
    /// Element index in the destination buffer of the box's first element.
    pub dst_base: i64,
    /// Number of dimensions used (0 for a single element).
    pub ndim: i64,
    /// Box extent per dimension.
    pub lengths: [i64; MAX_NDIM],
    /// Source stride per dimension.
    pub src_strides: [i64; MAX_NDIM],
    /// Destination stride per dimension.
    pub dst_strides: [i64; MAX_NDIM],
    /// 0: a plain copy (cast fused). `k > 0`: dequantize with scale `k - 1` of the batch
    /// ([`crate::exec::Scale`]): each element becomes `f32(q) * f32(scale[block])`, rounded once.
    pub scale: i64,
}

/// A 1-d strided copy, repeated: for `r` in `0..reps`, `count` elements from the file at
/// `src_off + r * rep_src_stride + i * src_stride` to `dst_addr + r * rep_dst_stride + i * dst_stride`
/// (bytes). One repetition is a "1-d run"; a column slice of a row-major matrix is one `Run` with one
/// repetition per row. Built only by [`crate::runs::plan`] (and split by the executor), which checked the bytes of every
/// repetition; `crate::dest` relies on that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// The item it came from.
    pub item: usize,
    /// File index.
    pub file: usize,
    /// Absolute byte offset in the file of the first element.
    pub src_off: u64,
    /// Source byte stride (unused for sub-byte runs, which are dense).
    pub src_stride: u64,
    /// Number of elements of one repetition.
    pub count: u64,
    /// Address of the first destination element.
    pub dst_addr: usize,
    /// Destination byte stride (unused for sub-byte runs, which are dense).
    pub dst_stride: usize,
    /// Number of repetitions (at least 1).
    pub reps: u64,
    /// Source byte distance between repetitions (byte aligned, also for sub-byte types).
    pub rep_src_stride: u64,
    /// Destination byte distance between repetitions.
    pub rep_dst_stride: usize,
    /// Source element type.
    pub src_dtype: Dtype,
    /// Destination element type.
    pub dst_dtype: Dtype,
    /// 0 for every run but the packed 4-bit runs of a dequantized MXFP4 item: 1 (2) when each element is
    /// the low (high) nibble of the byte at `src_off + i * src_stride` (strides in bytes, as for byte-sized
    /// elements of one byte; see [`crate::runs::plan`]).
    pub src_nibble: u8,
}

impl Run {
    fn src_elem_size(&self) -> u64 {
        match self.src_nibble {
            0 => self.src_dtype.byte_size().unwrap_or(0) as u64,
            _ => 1,
        }
    }

    /// Whether the source is packed sub-byte elements read densely (not a nibble run).
    fn packed_src(&self) -> bool {
        self.src_dtype.is_sub_byte() && self.src_nibble == 0
    }

    /// Destination element size in bytes (0 for sub-byte types).
    pub fn dst_elem_size(&self) -> usize {
        self.dst_dtype.byte_size().unwrap_or(0)
    }

    /// Whether source elements are adjacent.
    pub fn src_is_dense(&self) -> bool {
        self.packed_src() || self.count == 1 || self.src_stride == self.src_elem_size()
    }

    /// Whether destination elements are adjacent.
    pub fn dst_is_dense(&self) -> bool {
        self.dst_dtype.is_sub_byte() || self.count == 1 || self.dst_stride == self.dst_elem_size()
    }

    /// Bytes from the first source byte of one repetition to one past its last.
    pub fn run_extent(&self) -> u64 {
        if self.packed_src() {
            self.count * self.src_dtype.bits() / 8
        } else {
            (self.count - 1) * self.src_stride + self.src_elem_size()
        }
    }

    /// Bytes from the first source byte to one past the last byte of the last repetition (the span,
    /// including whatever lies between repetitions).
    pub fn src_extent(&self) -> u64 {
        (self.reps - 1) * self.rep_src_stride + self.run_extent()
    }

    /// One past the last source byte of the last repetition.
    pub fn src_end(&self) -> u64 {
        self.src_off + self.src_extent()
    }

    /// Source bytes the repetitions actually read: `reps` times [`Run::run_extent`].
    pub fn needed_bytes(&self) -> u64 {
        self.reps * self.run_extent()
    }

    /// Bytes written by one repetition (its destination extent when the destination is dense).
    pub fn dst_bytes(&self) -> usize {
        if self.dst_dtype.is_sub_byte() {
            (self.count * self.dst_dtype.bits() / 8) as usize
        } else {
            self.count as usize * self.dst_elem_size()
        }
    }

    /// Whether one repetition is a plain byte copy that can be read straight into the destination.
    pub fn is_direct(&self) -> bool {
        self.src_dtype == self.dst_dtype && self.src_is_dense() && self.dst_is_dense()
    }

    /// Whether every repetition's element `i` lies before any repetition's element `i + 1` in the source
    /// (repetitions are neighbouring columns of the same rows: `(reps - 1) * rep_src_stride` plus an element
    /// fits in one `src_stride`), so that a run of rows `a..b` of every repetition is one span of the file.
    pub fn interleaved(&self) -> bool {
        self.count > 1
            && !self.packed_src()
            && (self.reps - 1) * self.rep_src_stride + self.src_elem_size() <= self.src_stride
    }

    /// Repetition `r` (< `reps`) as a run of its own.
    pub fn rep(&self, r: u64) -> Run {
        debug_assert!(r < self.reps);
        Run {
            src_off: self.src_off + r * self.rep_src_stride,
            dst_addr: self.dst_addr + r as usize * self.rep_dst_stride,
            reps: 1,
            rep_src_stride: 0,
            rep_dst_stride: 0,
            ..*self
        }
    }

    /// Appends every repetition as a run of its own.
    pub fn expand(&self, out: &mut Vec<Run>) {
        out.extend((0..self.reps).map(|r| self.rep(r)));
    }

    /// Splits the run into consecutive pieces whose source extent is at most `max_extent` bytes: groups
    /// of repetitions (at least one each), and, when one repetition is longer than that, bands of rows of
    /// every repetition when they are [`Run::interleaved`], else pieces of repetitions of at least one
    /// element each (sub-byte pieces stay byte aligned).
    pub fn split(&self, max_extent: u64, out: &mut Vec<Run>) {
        if self.src_extent() <= max_extent {
            out.push(*self);
            return;
        }
        // A repeated run whose repetitions are neighbouring columns of the same rows, each longer than the
        // limit, is cut into bands of rows below, every repetition in each: a transposed slice stays one
        // tiled copy rather than one column copy per piece.
        let extent = self.run_extent();
        if self.reps > 1 && !(extent > max_extent && self.interleaved()) {
            if extent > max_extent {
                for r in 0..self.reps {
                    self.rep(r).split(max_extent, out);
                }
                return;
            }
            // The span exceeds `max_extent`, so the stride is not 0.
            let per = ((max_extent - extent) / self.rep_src_stride + 1).min(self.reps);
            let mut done = 0;
            while done < self.reps {
                let n = per.min(self.reps - done);
                out.push(Run {
                    src_off: self.src_off + done * self.rep_src_stride,
                    dst_addr: self.dst_addr + done as usize * self.rep_dst_stride,
                    reps: n,
                    ..*self
                });
                done += n;
            }
            return;
        }
        if self.count == 1 {
            out.push(*self);
            return;
        }
        let (per, src_step, dst_step) = if self.packed_src() {
            let bits = self.src_dtype.bits();
            let per = ((max_extent * 8 / bits) / 8 * 8).max(8);
            (per, per * bits / 8, (per * bits / 8) as usize)
        } else {
            // the bytes of one row of every repetition (one element when not repeated)
            let span = (self.reps - 1) * self.rep_src_stride + self.src_elem_size();
            let per = max_extent
                .saturating_sub(span)
                .checked_div(self.src_stride)
                .map_or(self.count, |q| q + 1);
            (per, per * self.src_stride, per as usize * self.dst_stride)
        };
        let mut done = 0;
        while done < self.count {
            let n = per.min(self.count - done);
            out.push(Run {
                src_off: self.src_off + (done / per) * src_step,
                dst_addr: self.dst_addr + (done / per) as usize * dst_step,
                count: n,
                ..*self
            });
            done += n;
        }
    }
}
