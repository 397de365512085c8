//! Exact destination-overlap check on run descriptors, without expanding repetitions or elements.
//!
//! Every [`Run`] writes a set of destination byte intervals that is one or a few *progressions*: `n`
//! intervals of `width` bytes, `stride` bytes apart. A dense repetition is one interval, a column of a
//! matrix is a progression of one-element intervals, a repeated dense run is a progression of its
//! repetitions; only a run strided in both its elements and its repetitions (no unit-stride destination
//! dimension at all) becomes several progressions (the shorter of its two dimensions). Two progressions
//! meet or not by arithmetic: with equal strides (interleaved column slices of one output) in O(1), with
//! different strides after a gcd test that settles most cases, else by walking the shorter one's elements in
//! the span they share. A sweep over the progressions sorted by start compares only those whose spans
//! intersect. Memory is O(progressions); the work is bounded by [`PAIR_BUDGET`] and [`STEP_BUDGET`], beyond
//! which the answer is [`Overlap::Undecided`] and the caller falls back to expanding elements.
//!
//! It reads nothing and owns no pointers: addresses are numbers here.
//!
//! ```text
//! eight [4M, 1] column boxes of a [4M, 8] fp32 output: 8 progressions (stride 32, width 4), 28 pairs,
//! each decided in O(1) — instead of 32M expanded elements sorted
//! ```

use crate::types::Run;

/// Most pairs of progressions with intersecting spans compared before giving up.
pub(crate) const PAIR_BUDGET: u64 = 1 << 22;
/// Most elements walked (pairs of unequal strides that the gcd test does not settle) before giving up.
pub(crate) const STEP_BUDGET: u64 = 1 << 24;
/// Most progressions made from runs strided in both dimensions before giving up.
const PROGRESSION_BUDGET: u64 = 1 << 22;

/// The answer of [`check`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Overlap {
    /// No destination byte is written twice.
    Disjoint,
    /// Runs `.0` and `.1` (indices, possibly equal) write some byte twice.
    Clash(usize, usize),
    /// The budgets ran out before an answer: expand and check element by element.
    Undecided,
}

/// `n` intervals `[start + i * stride, start + i * stride + width)` for `i` in `0..n`, from run `run`.
#[derive(Clone, Copy, Debug)]
struct Progression {
    start: i128,
    stride: i128,
    n: i128,
    width: i128,
    run: usize,
}

impl Progression {
    /// One past the last byte of the last interval.
    fn end(&self) -> i128 {
        self.start + (self.n - 1) * self.stride + self.width
    }

    /// Whether two of its own intervals share a byte.
    fn self_overlaps(&self) -> bool {
        self.n > 1 && self.stride < self.width
    }
}

/// The progressions of one run, appended to `out`; `false` when the budget of made progressions ran out.
fn progressions(i: usize, r: &Run, out: &mut Vec<Progression>, made: &mut u64) -> bool {
    let at = |start: usize, stride: usize, n: u64, width: usize| Progression {
        start: start as i128,
        stride: stride as i128,
        n: i128::from(n),
        width: width as i128,
        run: i,
    };
    if r.dst_is_dense() {
        out.push(at(r.dst_addr, r.rep_dst_stride, r.reps, r.dst_bytes()));
        return true;
    }
    let e = r.dst_elem_size();
    if r.reps == 1 {
        out.push(at(r.dst_addr, r.dst_stride, r.count, e));
        return true;
    }
    // Strided elements and strided repetitions: one progression along the longer dimension per step of
    // the shorter.
    let (outer, outer_stride, inner, inner_stride) = match r.reps <= r.count {
        true => (r.reps, r.rep_dst_stride, r.count, r.dst_stride),
        false => (r.count, r.dst_stride, r.reps, r.rep_dst_stride),
    };
    *made += outer;
    if *made > PROGRESSION_BUDGET {
        return false;
    }
    for k in 0..outer as usize {
        out.push(at(r.dst_addr + k * outer_stride, inner_stride, inner, e));
    }
    true
}

fn floor_div(a: i128, b: i128) -> i128 {
    a.div_euclid(b)
}

/// Whether the single interval `[a, a + w)` meets progression `q` (whose stride is positive when it has
/// more than one interval).
fn interval_meets(a: i128, w: i128, q: &Progression) -> bool {
    if q.n == 1 {
        return a < q.start + q.width && q.start < a + w;
    }
    // The first interval of q that ends after a: index j with q.start + j * stride + width > a.
    let j = (floor_div(a - q.width - q.start, q.stride) + 1).max(0);
    j < q.n && q.start + j * q.stride < a + w
}

/// Whether `p` and `q` (each free of self-overlap) share a byte; `None` when `steps` ran out.
fn meet(p: &Progression, q: &Progression, steps: &mut u64) -> Option<bool> {
    if p.n == 1 {
        return Some(interval_meets(p.start, p.width, q));
    }
    if q.n == 1 {
        return Some(interval_meets(q.start, q.width, p));
    }
    let d = q.start - p.start;
    if p.stride == q.stride {
        // p's interval i and q's interval j meet when (i - j) * s lies in (d - p.width, d + q.width); any k = i - j
        // in -(q.n - 1)..=(p.n - 1) is reachable. The smallest k above the lower bound decides.
        let s = p.stride;
        let k = (floor_div(d - p.width, s) + 1).max(-(q.n - 1));
        return Some(k < p.n && k * s < d + q.width);
    }
    // Interval j of q meets interval i of p when (q's start - p's start) lies in (-q.width, p.width); that
    // difference is d modulo g = gcd(strides), so no value of that residue in the range means no meeting.
    let g = gcd(p.stride, q.stride);
    let lowest = -q.width + 1; // smallest allowed difference
    let first = lowest + (d - lowest).rem_euclid(g);
    if first >= p.width {
        return Some(false);
    }
    // Walk the progression with fewer intervals inside the span the two share.
    let (few, many) = match p.n <= q.n {
        true => (p, q),
        false => (q, p),
    };
    let lo = many.start.max(few.start);
    let hi = many.end().min(few.end());
    if lo >= hi {
        return Some(false);
    }
    let first_i = (floor_div(lo - few.width - few.start, few.stride) + 1).max(0);
    let last_i = floor_div(hi - 1 - few.start, few.stride).min(few.n - 1);
    if last_i < first_i {
        return Some(false);
    }
    let count = (last_i - first_i + 1) as u64;
    *steps = steps.checked_sub(count)?;
    Some((first_i..=last_i).any(|i| interval_meets(few.start + i * few.stride, few.width, many)))
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.abs()
}

/// Whether any destination byte is written by two runs, or twice by one.
pub(crate) fn check(runs: &[Run]) -> Overlap {
    let mut progs: Vec<Progression> = Vec::with_capacity(runs.len());
    let mut made = 0;
    for (i, r) in runs.iter().enumerate() {
        if r.count == 0 || r.reps == 0 || r.dst_bytes() == 0 {
            continue;
        }
        if !progressions(i, r, &mut progs, &mut made) {
            return Overlap::Undecided;
        }
    }
    if let Some(p) = progs.iter().find(|p| p.self_overlaps()) {
        return Overlap::Clash(p.run, p.run);
    }
    progs.sort_unstable_by_key(|p| (p.start, p.run));
    let (mut pairs, mut steps) = (0u64, STEP_BUDGET);
    let mut active: Vec<(i128, usize)> = Vec::new(); // (span end, position in progs)
    for (at, p) in progs.iter().enumerate() {
        active.retain(|&(end, _)| end > p.start);
        for &(_, other) in &active {
            let q = &progs[other];
            pairs += 1;
            if pairs > PAIR_BUDGET {
                return Overlap::Undecided;
            }
            match meet(q, p, &mut steps) {
                None => return Overlap::Undecided,
                Some(true) => return Overlap::Clash(q.run, p.run),
                Some(false) => {}
            }
        }
        active.push((p.end(), at));
    }
    Overlap::Disjoint
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn run(
        dst_addr: usize,
        count: u64,
        dst_stride: usize,
        reps: u64,
        rep_dst_stride: usize,
    ) -> Run {
        Run {
            item: 0,
            file: 0,
            src_off: 0,
            src_stride: 4,
            count,
            dst_addr,
            dst_stride,
            reps,
            rep_src_stride: 0,
            rep_dst_stride,
            src_dtype: Dtype::F32,
            dst_dtype: Dtype::F32,
            src_nibble: 0,
        }
    }

    /// Element by element: the first byte written twice decides.
    fn naive(runs: &[Run]) -> bool {
        let mut owner: HashMap<usize, ()> = HashMap::new();
        for r in runs {
            for k in 0..r.reps as usize {
                for i in 0..r.count as usize {
                    let a = r.dst_addr + k * r.rep_dst_stride + i * r.dst_stride;
                    for b in a..a + r.dst_elem_size() {
                        if owner.insert(b, ()).is_some() {
                            return true;
                        }
                    }
                }
            }
        }
        false
    }

    #[test]
    fn interleaved_columns_are_disjoint_and_a_shared_column_clashes() {
        // Eight [n, 1] column boxes of a [n, 8] fp32 output, one run each: 8 progressions, O(1) per pair.
        let n = 4 << 20;
        let cols: Vec<Run> = (0..8).map(|c| run(c * 4, n, 32, 1, 0)).collect();
        assert_eq!(check(&cols), Overlap::Disjoint);
        let mut clash = cols.clone();
        clash.push(run(5 * 4 + 32 * (n as usize - 1), 1, 4, 1, 0)); // the last element of column 5
        assert_eq!(check(&clash), Overlap::Clash(5, 8));
        // Two-column boxes as repeated dense runs (reps = rows), and one box shifted by one column.
        let pairs: Vec<Run> = (0..4).map(|c| run(c * 8, 2, 4, n, 32)).collect();
        assert_eq!(check(&pairs), Overlap::Disjoint);
        let mut shifted = pairs.clone();
        shifted[3] = run(5 * 4, 2, 4, n, 32);
        assert!(matches!(check(&shifted), Overlap::Clash(..)));
    }

    #[test]
    fn self_overlap_and_unequal_strides() {
        assert_eq!(check(&[run(0, 4, 0, 1, 0)]), Overlap::Clash(0, 0));
        assert_eq!(check(&[run(0, 2, 4, 3, 4)]), Overlap::Clash(0, 0));
        // fp32 elements 8 bytes apart, and others 16 apart at 4 mod 16: the gcd test separates them.
        let a = run(0, 100, 8, 1, 0);
        let b = run(4, 3, 16, 1, 0);
        assert!(!naive(&[a, b]));
        assert_eq!(check(&[a, b]), Overlap::Disjoint);
        // 12 apart from 4: gcd 4 does not separate them; the walk finds 16, a's third element.
        let c = run(4, 3, 12, 1, 0);
        assert_eq!(check(&[a, c]), Overlap::Clash(0, 1));
        // 28 apart from 4 (4, 32) next to a's 0, 8, 16: walked, disjoint within the shared span.
        let d = run(4, 2, 28, 1, 0);
        assert_eq!(check(&[run(0, 3, 8, 1, 0), d]), Overlap::Disjoint);
    }

    /// Random runs in a small buffer: the descriptor check agrees with element-by-element expansion.
    fn runs_strategy() -> impl Strategy<Value = Vec<Run>> {
        let one = (
            0usize..64,
            1u64..6,
            0usize..5,
            1u64..6,
            0usize..7,
            0usize..3,
        )
            .prop_map(|(start, count, stride, reps, rep_stride, size)| {
                let dtype = [Dtype::U8, Dtype::BF16, Dtype::F32][size];
                let e = dtype.byte_size().unwrap();
                Run {
                    dst_dtype: dtype,
                    src_dtype: dtype,
                    ..run(start, count, stride * e, reps, rep_stride * e)
                }
            });
        proptest::collection::vec(one, 1..6)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
        #[test]
        fn agrees_with_naive_expansion(runs in runs_strategy()) {
            let runs: Vec<Run> = runs.into_iter().enumerate().map(|(i, r)| Run { item: i, ..r }).collect();
            let got = check(&runs);
            prop_assert_ne!(&got, &Overlap::Undecided);
            prop_assert_eq!(got != Overlap::Disjoint, naive(&runs), "{:?}", runs);
        }
    }
}
