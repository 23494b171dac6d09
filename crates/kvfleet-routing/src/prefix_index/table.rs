//! The index's hash table: block hash → (slot, holder count), open addressing with
//! linear probing and inline 16-byte entries.
//!
//! A general-purpose map keeps control bytes and buckets in separate arrays, so a
//! cold lookup touches two cache lines (and two pages). Here a lookup usually touches
//! one line: that halves the memory stalls of `find_matches`, whose probes are cold
//! by nature (a 1M-block index is far larger than the CPU caches). Deletion shifts
//! later entries back instead of leaving tombstones, so probe chains stay short under
//! the constant churn of KV events.

/// Marks an empty entry (slot numbers never reach it).
const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub key: u64,
    pub slot: u32,
    pub holders: u32,
}

const VACANT: Entry = Entry {
    key: 0,
    slot: EMPTY,
    holders: 0,
};

#[derive(Clone, Debug)]
pub(super) struct BlockTable {
    entries: Vec<Entry>,
    // log2(entries.len()); homes come from the top bits of a Fibonacci hash.
    bits: u32,
    len: usize,
}

impl BlockTable {
    /// A table that holds `capacity` keys without growing.
    pub fn with_capacity(capacity: usize) -> Self {
        // Keep the load factor at or below 1/2: short probes, cheap misses.
        let size = (capacity.max(8) * 2).next_power_of_two();
        Self {
            entries: vec![VACANT; size],
            bits: size.trailing_zeros(),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Block hashes are uniform already, but the multiply protects the table from
        // structured keys (tests, or a bad hash upstream) at the cost of one multiply.
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - self.bits)) as usize
    }

    /// The entry for `key`, if present.
    #[inline]
    pub fn get(&self, key: u64) -> Option<&Entry> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.slot == EMPTY {
                return None;
            }
            if e.key == key {
                return Some(e);
            }
            i = (i + 1) & mask;
        }
    }

    /// The entry for `key`, mutably, if present.
    #[inline]
    pub fn get_mut(&mut self, key: u64) -> Option<&mut Entry> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.slot == EMPTY {
                return None;
            }
            if e.key == key {
                return self.entries.get_mut(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The entry for `key`, inserting `{slot: new_slot(), holders: 0}` if absent.
    /// Returns the entry and whether it was inserted.
    #[inline]
    pub fn get_or_insert_with(
        &mut self,
        key: u64,
        new_slot: impl FnOnce() -> u32,
    ) -> (&mut Entry, bool) {
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.slot == EMPTY {
                self.entries[i] = Entry {
                    key,
                    slot: new_slot(),
                    holders: 0,
                };
                self.len += 1;
                return (&mut self.entries[i], true);
            }
            if e.key == key {
                return (&mut self.entries[i], false);
            }
            i = (i + 1) & mask;
        }
    }

    /// Removes `key`, returning its entry.
    pub fn remove(&mut self, key: u64) -> Option<Entry> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = self.entries[i];
            if e.slot == EMPTY {
                return None;
            }
            if e.key == key {
                break;
            }
            i = (i + 1) & mask;
        }
        let removed = self.entries[i];
        // Backward-shift deletion: pull later entries of the run into the hole when
        // their home is at or before it, so every key stays reachable without
        // tombstones.
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let e = self.entries[j];
            if e.slot == EMPTY {
                break;
            }
            let h = self.home(e.key);
            if (j.wrapping_sub(h) & mask) >= (j.wrapping_sub(i) & mask) {
                self.entries[i] = e;
                i = j;
            }
        }
        self.entries[i] = VACANT;
        self.len -= 1;
        Some(removed)
    }

    fn grow(&mut self) {
        let old = std::mem::take(&mut self.entries);
        let size = old.len() * 2;
        self.entries = vec![VACANT; size];
        self.bits = size.trailing_zeros();
        let mask = self.mask();
        for e in old.into_iter().filter(|e| e.slot != EMPTY) {
            let mut i = self.home(e.key);
            while self.entries[i].slot != EMPTY {
                i = (i + 1) & mask;
            }
            self.entries[i] = e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]

        /// Agrees with std's HashMap under inserts and removals of clustered keys.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<bool>(), 0u64..300), 1..2_000)) {
            let mut t = BlockTable::with_capacity(4);
            let mut m: HashMap<u64, u32> = HashMap::new();
            let mut next = 0u32;
            for (insert, k) in ops {
                // Structured keys: small integers and multiples of a power of two.
                let key = if k % 2 == 0 { k } else { k << 40 };
                if insert {
                    let (e, new) = t.get_or_insert_with(key, || { next += 1; next });
                    e.holders += 1;
                    let want_new = !m.contains_key(&key);
                    prop_assert_eq!(new, want_new);
                    let slot = *m.entry(key).or_insert(e.slot);
                    prop_assert_eq!(e.slot, slot);
                } else {
                    prop_assert_eq!(t.remove(key).map(|e| e.slot), m.remove(&key));
                }
                prop_assert_eq!(t.len(), m.len());
            }
            for (k, slot) in &m {
                prop_assert_eq!(t.get(*k).map(|e| e.slot), Some(*slot));
            }
            prop_assert!(t.get(u64::MAX).is_none());
        }
    }
}
