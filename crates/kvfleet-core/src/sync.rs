//! Poison-tolerant locking, the one helper every crate uses.
//!
//! A thread that panics while holding a lock poisons it. The structures kvfleet keeps
//! behind mutexes stay consistent between calls (each call completes its update or
//! makes none), so the data is taken back rather than every later caller failing.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the data if a panicking thread poisoned it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_still_locks_with_its_data() {
        let m = std::sync::Arc::new(Mutex::new(41));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g += 1;
            panic!("poison it");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 42);
    }
}
