//! A map bounded by the bytes its values hold, not by their count: past the bound the
//! least recently used entries go first. Every operation is O(1) (a hash map into a
//! slab of nodes on an intrusive doubly linked list, most recent at the head).
//!
//! The caller states each entry's size when it inserts it; the bound then holds
//! exactly: [`ByteLru::bytes`] never exceeds [`ByteLru::max_bytes`] after a call. An
//! entry larger than the whole bound is not kept at all.

use std::collections::HashMap;
use std::hash::Hash;

const NIL: usize = usize::MAX;

struct Node<K, V> {
    key: K,
    value: V,
    bytes: usize,
    prev: usize,
    next: usize,
}

/// An LRU map bounded in bytes (see the module docs).
pub struct ByteLru<K, V> {
    index: HashMap<K, usize>,
    nodes: Vec<Option<Node<K, V>>>,
    free: Vec<usize>,
    /// Most recently used.
    head: usize,
    /// Least recently used: the next to go.
    tail: usize,
    bytes: usize,
    max_bytes: usize,
}

impl<K: Hash + Eq + Clone, V> ByteLru<K, V> {
    /// An empty map that holds at most `max_bytes` of entries.
    pub fn new(max_bytes: usize) -> Self {
        ByteLru {
            index: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            bytes: 0,
            max_bytes,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes held: the sum of the sizes entries were inserted with.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The bound.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Whether `key` is held (it is not marked used).
    pub fn contains(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    /// The value of `key`, without marking it used.
    pub fn peek(&self, key: &K) -> Option<&V> {
        let i = *self.index.get(key)?;
        self.nodes[i].as_ref().map(|n| &n.value)
    }

    /// The value of `key`, marked most recently used.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        self.get_mut(key).map(|v| &*v)
    }

    /// The value of `key` to change in place, marked most recently used. The change
    /// must not alter what the entry's size counted (re-[`insert`](Self::insert) for that).
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = *self.index.get(key)?;
        self.unlink(i);
        self.push_front(i);
        self.nodes[i].as_mut().map(|n| &mut n.value)
    }

    /// Inserts (or replaces) `key` as the most recently used entry, `bytes` large, then
    /// evicts least recently used entries until the bound holds. Returns whether the
    /// entry was kept (false: it alone is larger than the bound).
    pub fn insert(&mut self, key: K, value: V, bytes: usize) -> bool {
        self.remove(&key);
        if bytes > self.max_bytes {
            return false;
        }
        while self.bytes + bytes > self.max_bytes {
            if self.pop_lru().is_none() {
                break;
            }
        }
        let node = Node {
            key: key.clone(),
            value,
            bytes,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.push_front(i);
        self.index.insert(key, i);
        self.bytes += bytes;
        true
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.nodes
            .iter()
            .filter_map(|n| n.as_ref().map(|n| (&n.key, &n.value)))
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.index.remove(key)?;
        self.take(i).map(|(_, v)| v)
    }

    /// Removes the least recently used entry.
    pub fn pop_lru(&mut self) -> Option<(K, V)> {
        if self.tail == NIL {
            return None;
        }
        let i = self.tail;
        let (k, v) = self.take(i)?;
        self.index.remove(&k);
        Some((k, v))
    }

    fn take(&mut self, i: usize) -> Option<(K, V)> {
        self.unlink(i);
        let node = self.nodes[i].take()?;
        self.free.push(i);
        self.bytes -= node.bytes;
        Some((node.key, node.value))
    }

    fn unlink(&mut self, i: usize) {
        let Some((prev, next)) = self.nodes[i].as_ref().map(|n| (n.prev, n.next)) else {
            return;
        };
        match prev {
            NIL => self.head = next,
            p => self.set_next(p, next),
        }
        match next {
            NIL => self.tail = prev,
            n => self.set_prev(n, prev),
        }
        if let Some(n) = self.nodes[i].as_mut() {
            n.prev = NIL;
            n.next = NIL;
        }
    }

    fn push_front(&mut self, i: usize) {
        let old = self.head;
        if let Some(n) = self.nodes[i].as_mut() {
            n.prev = NIL;
            n.next = old;
        }
        match old {
            NIL => self.tail = i,
            h => self.set_prev(h, i),
        }
        self.head = i;
    }

    fn set_next(&mut self, i: usize, next: usize) {
        if let Some(n) = self.nodes[i].as_mut() {
            n.next = next;
        }
    }

    fn set_prev(&mut self, i: usize, prev: usize) {
        if let Some(n) = self.nodes[i].as_mut() {
            n.prev = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys from least to most recently used, walking the list.
    fn order(m: &ByteLru<u32, u32>) -> Vec<u32> {
        let mut out = Vec::new();
        let mut i = m.tail;
        while i != NIL {
            let n = m.nodes[i].as_ref().unwrap();
            out.push(n.key);
            i = n.prev;
        }
        out
    }

    #[test]
    fn inserting_past_the_bound_evicts_the_oldest_first() {
        let mut m = ByteLru::new(100);
        for k in 0..4 {
            assert!(m.insert(k, k, 30));
        }
        // 4 × 30 > 100: the first inserted went.
        assert_eq!(m.bytes(), 90);
        assert_eq!(order(&m), vec![1, 2, 3]);
        // A large entry pushes out as many of the oldest as it needs.
        assert!(m.insert(9, 9, 70));
        assert_eq!(order(&m), vec![3, 9]);
        assert_eq!(m.bytes(), 100);
    }

    #[test]
    fn use_refreshes_an_entry() {
        let mut m = ByteLru::new(90);
        for k in 0..3 {
            m.insert(k, k, 30);
        }
        assert_eq!(m.get(&0), Some(&0));
        m.insert(3, 3, 30);
        assert_eq!(order(&m), vec![2, 0, 3]);
        assert!(!m.contains(&1));
        // peek does not refresh.
        assert_eq!(m.peek(&2), Some(&2));
        m.insert(4, 4, 30);
        assert!(!m.contains(&2));
    }

    #[test]
    fn replacing_an_entry_recounts_its_bytes() {
        let mut m = ByteLru::new(100);
        m.insert(1, 1, 40);
        m.insert(2, 2, 40);
        m.insert(1, 10, 10);
        assert_eq!((m.len(), m.bytes()), (2, 50));
        assert_eq!(order(&m), vec![2, 1]);
        assert_eq!(m.remove(&2), Some(2));
        assert_eq!((m.len(), m.bytes()), (1, 10));
        assert_eq!(m.pop_lru(), Some((1, 10)));
        assert!(m.is_empty() && m.bytes() == 0);
    }

    #[test]
    fn an_entry_larger_than_the_bound_is_not_kept() {
        let mut m = ByteLru::new(100);
        m.insert(1, 1, 60);
        assert!(!m.insert(2, 2, 101));
        assert_eq!(order(&m), vec![1]);
        // Replacing a held entry with one too large drops it.
        assert!(!m.insert(1, 1, 200));
        assert!(m.is_empty());
    }

    #[test]
    fn the_bound_holds_under_churn_and_slots_are_reused() {
        let mut m = ByteLru::new(1000);
        let mut x = 12345u32;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let key = x % 64;
            if x.is_multiple_of(7) {
                m.remove(&key);
            } else if x.is_multiple_of(5) {
                m.get(&key);
            } else {
                m.insert(key, x, (x % 200) as usize + 1);
            }
            assert!(m.bytes() <= 1000);
            assert_eq!(order(&m).len(), m.len());
            let sum: usize = m.nodes.iter().flatten().map(|n| n.bytes).sum();
            assert_eq!(sum, m.bytes());
        }
        assert!(m.nodes.len() <= 64, "freed slots are reused");
    }
}
