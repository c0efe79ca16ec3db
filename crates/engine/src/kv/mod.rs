//! KV caches. Preallocated to a maximum length and updated in place (never concatenated),
//! so decode steps have fixed shapes. A sliding-window layer keeps only a ring of slots
//! (`layer_slots`): the positions its queries can still attend, plus one forward call's
//! worth of new ones.

pub mod blocks;
pub mod dense;
pub mod paged;

use crate::config::{AttnKind, ModelConfig};

/// Most positions one forward call may write to a ring (the model splits longer calls):
/// the CUDA backend's prefill chunk.
pub const RING_ROWS: usize = 512;

/// Slots a layer's cache holds for `max_seq` positions: one per position, or for a layer
/// attending the last `window` positions a ring of window + RING_ROWS - 1 slots (position
/// p in slot p mod slots) where that is fewer. A call writing m ≤ RING_ROWS positions from
/// pos0 overwrites only positions before pos0 + m - slots ≤ pos0 - window, which no query
/// of the call attends.
pub fn layer_slots(window: Option<usize>, max_seq: usize) -> usize {
    match window {
        Some(w) => max_seq.min(w.saturating_add(RING_ROWS - 1)),
        None => max_seq,
    }
}

/// `layer_slots` of each of the model's layers.
pub fn slots(cfg: &ModelConfig, max_seq: usize) -> Vec<usize> {
    (0..cfg.n_layers)
        .map(|i| {
            let window = (cfg.layer_kind(i) == AttnKind::Sliding).then_some(cfg.sliding_window);
            layer_slots(window, max_seq)
        })
        .collect()
}

/// Whether any layer of a cache of these slots is a ring: then a forward call may write at
/// most RING_ROWS positions.
pub fn has_ring(slots: &[usize], max_seq: usize) -> bool {
    slots.iter().any(|&s| s < max_seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_hold_the_window_and_one_call() {
        assert_eq!(layer_slots(None, 32768), 32768);
        assert_eq!(layer_slots(Some(512), 32768), 1023);
        assert_eq!(layer_slots(Some(512), 800), 800);
        assert_eq!(layer_slots(Some(usize::MAX), 64), 64);
        // Every position a query of a call attends survives the call's writes: the call
        // overwrites slots of positions < pos0 + m - slots ≤ pos0 - window + 1 - 1.
        let (w, slots) = (9, layer_slots(Some(9), 4096));
        for m in [1, 7, RING_ROWS] {
            let pos0 = 3000;
            let oldest_needed = pos0 + 1 - w; // the first query's first position
            let newest_overwritten = (pos0 + m).saturating_sub(slots + 1);
            assert!(newest_overwritten < oldest_needed, "m {m}");
        }
    }
}
