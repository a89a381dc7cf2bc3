//! The last few results a search computed, by key: neighbouring
//! configurations of a space differ in switches that leave their memory
//! (or model-state) key alone, so the few most recent verdicts answer most
//! lookups. Fixed-size and on the stack, so nothing allocates per
//! configuration.

/// How many results a [`Recent`] keeps (the configurations the innermost
/// switches of a space produce around one key).
pub const CAPACITY: usize = 16;

/// The last [`CAPACITY`] values inserted, by key. A lookup looks at the
/// newest first; an insert replaces the oldest.
#[derive(Debug, Clone)]
pub struct Recent<K, V> {
    slots: [Option<(K, V)>; CAPACITY],
    /// The slot the next insert fills: the oldest once all are full.
    next: usize,
    /// The slot that answered the last lookup, looked at first: a search
    /// asks for one key many times in a row (the innermost switches leave
    /// it alone), and comparing keys is most of a lookup's cost.
    last: usize,
}

impl<K: Copy + PartialEq, V: Copy> Default for Recent<K, V> {
    fn default() -> Self {
        Recent {
            slots: [None; CAPACITY],
            next: 0,
            last: 0,
        }
    }
}

impl<K: Copy + PartialEq, V: Copy> Recent<K, V> {
    /// The value kept for `key`, newest first.
    #[cfg(test)]
    pub fn get(&self, key: &K) -> Option<V> {
        self.slot_of(key)
            .and_then(|i| self.slots[i])
            .map(|(_, v)| v)
    }

    /// The slot holding `key`, newest first.
    fn slot_of(&self, key: &K) -> Option<usize> {
        (1..=CAPACITY)
            .map(|back| (self.next + CAPACITY - back) % CAPACITY)
            // Slots fill in order: the first empty one going back is older
            // than every filled one.
            .take_while(|&i| self.slots[i].is_some())
            .find(|&i| self.slots[i].as_ref().is_some_and(|(k, _)| k == key))
    }

    /// Keeps `value` for `key` in place of the oldest entry.
    pub fn insert(&mut self, key: K, value: V) {
        self.slots[self.next] = Some((key, value));
        self.next = (self.next + 1) % CAPACITY;
    }

    /// The value kept for `key`, or `compute`'s, then kept.
    pub fn get_or_insert_with(&mut self, key: K, compute: impl FnOnce() -> V) -> V {
        *self.lend_or_insert_with(key, compute)
    }

    /// [`get_or_insert_with`](Self::get_or_insert_with), lent rather than
    /// copied (for values too large to copy on every lookup).
    pub fn lend_or_insert_with(&mut self, key: K, compute: impl FnOnce() -> V) -> &V {
        let last_answers = self.slots[self.last]
            .as_ref()
            .is_some_and(|(k, _)| *k == key);
        let slot = match last_answers {
            true => self.last,
            false => match self.slot_of(&key) {
                Some(slot) => slot,
                None => {
                    let slot = self.next;
                    self.insert(key, compute());
                    slot
                }
            },
        };
        self.last = slot;
        let (_, value) = self.slots[slot].as_ref().expect("a filled slot");
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys are found until CAPACITY newer ones pushed them out, the newest
    /// value of a key inserted twice wins, and compute runs only on a miss.
    #[test]
    fn keeps_the_last_capacity_entries_newest_first() {
        let mut recent = Recent::<u64, u64>::default();
        assert_eq!(recent.get(&0), None);
        for key in 0..CAPACITY as u64 {
            recent.insert(key, 10 * key);
        }
        assert!((0..CAPACITY as u64).all(|k| recent.get(&k) == Some(10 * k)));
        // One more pushes out the oldest, and only it.
        recent.insert(100, 1000);
        assert_eq!(recent.get(&0), None);
        assert_eq!(recent.get(&1), Some(10));
        assert_eq!(recent.get(&100), Some(1000));
        // A key kept twice answers with its newer value.
        recent.insert(5, 55);
        assert_eq!(recent.get(&5), Some(55));
        let mut computed = 0;
        let mut value = |key: u64, recent: &mut Recent<u64, u64>| {
            recent.get_or_insert_with(key, || {
                computed += 1;
                key + 1
            })
        };
        assert_eq!(value(100, &mut recent), 1000);
        assert_eq!(value(7000, &mut recent), 7001);
        assert_eq!(value(7000, &mut recent), 7001);
        assert_eq!(computed, 1);
    }
}
