//! Point-to-point messages and one-sided operations against what the peers sent.

use super::case::Input;
use crate::transport::onesided::{Accumulate, AccumulateError};
use crate::{Communicator, DType, Result};
use std::sync::Arc;

/// Tagged send/recv around the ring, then one-sided write/read/fetch-add through a window:
/// every rank writes a random block into its slot of every peer's region, reads each peer's
/// own block back, and adds to a counter on rank 0 whose returned old values must all
/// differ (atomicity) and whose final value must be the exact sum.
pub(super) fn p2p_and_onesided(comm: &Communicator, seed: u64) -> Result<Vec<String>> {
    use std::sync::Arc;
    let (w, me) = (comm.size(), comm.rank());
    let mut bad = vec![];
    if w == 1 {
        return Ok(bad);
    }
    // send/recv: even ranks send first, odd ranks receive first (no cycle of blocked sends).
    let n = 7919;
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let mine = Input::new(seed, me, 900_001, DType::F32).take(n);
    let out: Vec<f32> = mine.iter().map(|&v| v as f32).collect();
    let mut got = vec![0f32; n];
    if me % 2 == 0 {
        comm.send(&out, next, 7)?;
        comm.recv(&mut got, prev, 7)?;
    } else {
        comm.recv(&mut got, prev, 7)?;
        comm.send(&out, next, 7)?;
    }
    let want = Input::new(seed, prev, 900_001, DType::F32).take(n);
    if got.iter().zip(&want).any(|(g, w)| *g as f64 != *w) {
        bad.push(format!("rank {me}: send/recv from rank {prev}: data differs"));
    }
    // One-sided.
    const BLOCK_BYTES: usize = 512;
    let counter_at = 0;
    let slots_at = 64;
    let own_at = slots_at + w * BLOCK_BYTES;
    let sum_at = own_at + BLOCK_BYTES;
    let region = Arc::new(crate::Region::shared("check-window", sum_at + BLOCK_BYTES)?);
    let block = |r: usize| -> Vec<u8> {
        let v = Input::new(seed, r, 900_002, DType::F64).take(BLOCK_BYTES / 8);
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    };
    // SAFETY: nobody else can reach the region before `expose` returns.
    unsafe { std::ptr::copy_nonoverlapping(block(me).as_ptr(), region.as_ptr().add(own_at), BLOCK_BYTES) };
    let win = comm.expose_with(region.clone(), Some(Arc::new(AddF64 { region: region.clone(), at: sum_at, lock: Default::default() })))?;
    for p in 0..w {
        win.write(p, slots_at + me * BLOCK_BYTES, &block(me))?;
        if win.accumulates(p) {
            win.accumulate(p, sum_at, &block(me), ACCUMULATE_TAG)?;
            // A refused accumulate says why and leaves the connection usable.
            match win.accumulate(p, sum_at, &block(me), ACCUMULATE_TAG + 1) {
                Err(e) if e.to_string().contains("wrong tag") => {}
                other => bad.push(format!("rank {me}: accumulate with a wrong tag at rank {p}: expected a refusal naming it, got {other:?}")),
            }
        }
    }
    let mut olds = vec![];
    for _ in 0..FETCH_ADDS {
        olds.push(win.fetch_add(0, counter_at, (me + 1) as u64)? as f64);
    }
    comm.barrier()?;
    for p in 0..w {
        let mut theirs = vec![0u8; BLOCK_BYTES];
        win.read(p, own_at, &mut theirs)?;
        if theirs != block(p) {
            bad.push(format!("rank {me}: one-sided read of rank {p}'s block: data differs"));
        }
        let (mut last, mut head, mut tail) = (vec![0u8; 24], vec![0u8; 24], vec![0u8; BLOCK_BYTES - 24]);
        win.read_sequence(p, &mut [(own_at + BLOCK_BYTES - 24, &mut last), (own_at, &mut head), (own_at + 24, &mut tail)])?;
        if [head, tail].concat() != block(p) || last != block(p)[BLOCK_BYTES - 24..] {
            bad.push(format!("rank {me}: one-sided read sequence of rank {p}'s block: data differs"));
        }
        // SAFETY: all writes to our region finished before the barrier.
        let landed = unsafe { std::slice::from_raw_parts(region.as_ptr().add(slots_at + p * BLOCK_BYTES), BLOCK_BYTES) };
        if landed != block(p).as_slice() {
            bad.push(format!("rank {me}: one-sided write from rank {p}: data differs"));
        }
    }
    // Accumulates from the ranks behind tcp: sums computed here from regenerated blocks.
    let senders: Vec<usize> = (0..w).filter(|&p| win.accumulates(p)).collect();
    // SAFETY: all accumulates into our region finished before the barrier.
    let summed = unsafe { std::slice::from_raw_parts(region.as_ptr().add(sum_at) as *const f64, BLOCK_BYTES / 8) };
    let mut want = vec![0f64; BLOCK_BYTES / 8];
    for &p in &senders {
        want.iter_mut().zip(Input::new(seed, p, 900_002, DType::F64).take(BLOCK_BYTES / 8)).for_each(|(w, x)| *w += x);
    }
    if summed.iter().zip(&want).any(|(s, w)| (s - w).abs() > 1e-9 * (1.0 + w.abs())) {
        bad.push(format!("rank {me}: one-sided accumulates from ranks {senders:?}: sum differs"));
    }
    let mut all_olds = vec![0f64; FETCH_ADDS * w];
    comm.allgather(&olds, &mut all_olds)?;
    all_olds.sort_by(f64::total_cmp);
    if all_olds.windows(2).any(|p| p[0] == p[1]) {
        bad.push(format!("rank {me}: fetch-add returned the same old value twice (not atomic)"));
    }
    if me == 0 {
        let total = win.fetch_add(0, counter_at, 0)?;
        let want: u64 = (1..=w as u64).sum::<u64>() * FETCH_ADDS as u64;
        if total != want {
            bad.push(format!("rank 0: fetch-add counter is {total}, expected {want}"));
        }
    }
    comm.barrier()?;
    Ok(bad)
}

const ACCUMULATE_TAG: u64 = 7;
/// Fetch-adds per rank on rank 0's counter, all at once: enough for a lost update between
/// a CPU atomic and a NIC's to show (see `NicAtomics`).
const FETCH_ADDS: usize = 100;

/// The check's accumulate: adds f64 payloads into the words at `at`, one request at a time.
struct AddF64 {
    region: Arc<crate::Region>,
    at: usize,
    lock: std::sync::Mutex<()>,
}

impl Accumulate for AddF64 {
    fn accumulate(&self, tag: u64, off: usize, len: usize, recv: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>) -> std::result::Result<(), AccumulateError> {
        if tag != ACCUMULATE_TAG || off != self.at || len % 8 != 0 {
            return Err(AccumulateError::Refused(format!("wrong tag {tag}, offset {off} or length {len}")));
        }
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut word = [0u8; 8];
        for i in 0..len / 8 {
            recv(&mut word)?;
            // SAFETY: off + len is inside the region (checked by the service); we hold the lock.
            unsafe { *(self.region.as_ptr().add(off + 8 * i) as *mut f64) += f64::from_le_bytes(word) };
        }
        Ok(())
    }
}
