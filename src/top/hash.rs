//! The sketches' hash: seeded per process, a multiply-rotate step per 8 bytes and a final
//! avalanche (MurmurHash3's `fmix64`).
//!
//! Why not SipHash (std's): with two descriptors a request, SipHash of the limit and of each
//! descriptor was 3.7% of the memory backend's instructions per request; this costs a fraction
//! of it. What it gives up is cryptographic strength, which the sketches do not need: a
//! descriptor's table holds at most `--top-capacity` entries, compared byte for byte, so
//! colliding hashes cost at most a scan of that many; and a limit's hash mixes the request's
//! numbers with a secret seed before the avalanche, so no client can aim overrides at one
//! bucket without knowing it.

use std::hash::{BuildHasher, Hasher};

/// Builds [`Fold`] hashers from one random seed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoldState {
    seed: u64,
}

impl FoldState {
    /// A state with a seed of its own.
    pub(crate) fn new() -> FoldState {
        FoldState {
            seed: std::hash::RandomState::new().hash_one(0x7a11u64),
        }
    }
}

impl BuildHasher for FoldState {
    type Hasher = Fold;

    fn build_hasher(&self) -> Fold {
        Fold(self.seed)
    }
}

/// See the module's documentation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fold(u64);

impl Fold {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(23) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl Hasher for Fold {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.add(u64::from_le_bytes(last) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i) | 1 << 62);
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_inputs_hash_equal_and_near_ones_apart() {
        let s = FoldState::new();
        assert_eq!(s.hash_one(("ab", 1u64)), s.hash_one(("ab", 1u64)));
        let mut seen = std::collections::HashSet::new();
        for v in [
            "",
            "a",
            "a\0",
            "ab",
            "b",
            "ba",
            "abcdefgh",
            "abcdefgh\0",
            "abcdefghi",
        ] {
            assert!(seen.insert(s.hash_one(v)), "{v:?} collides");
        }
        // Numbers that differ only in high bits land in different buckets of a small table.
        let buckets: std::collections::HashSet<u64> =
            (0..64u64).map(|i| s.hash_one(i << 40) & 1023).collect();
        assert!(buckets.len() > 48, "{}", buckets.len());
        // Another process (seed) hashes otherwise.
        assert_ne!(FoldState::new().hash_one("ab"), s.hash_one("ab"));
    }
}
