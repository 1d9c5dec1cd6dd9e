//! The gateway's memory of past responses, which `previous_response_id` continues and
//! `GET /v1/responses/{id}` returns. Bounded in count and in bytes (the oldest is forgotten
//! first) and in age, so a gateway serving for weeks holds at most
//! `--responses-max-stored` of them in at most `--responses-max-stored-bytes`;
//! in memory only, so a restart forgets them (a later reference is a 404, as for an
//! expired one).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub(crate) struct Store<T> {
    /// Most entries held; 0 holds none.
    max: usize,
    /// Most bytes held, summed over the entries' sizes as their inserts gave them.
    max_bytes: usize,
    /// How long an entry is found after it was stored.
    ttl: Duration,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    /// Each entry with when it was stored and its size.
    live: HashMap<String, (Instant, Arc<T>, usize)>,
    /// The sizes of `live`'s entries, summed.
    bytes: usize,
    /// Ids in the order they were stored (which, with one ttl for all, is the order they
    /// expire in); deleted ids linger here until they reach the front or a compaction.
    order: VecDeque<(Instant, String)>,
}

impl<T> Store<T> {
    pub fn new(max: usize, max_bytes: usize, ttl: Duration) -> Self {
        Self {
            max,
            max_bytes,
            ttl,
            inner: Mutex::new(Inner {
                live: HashMap::new(),
                bytes: 0,
                order: VecDeque::new(),
            }),
        }
    }

    /// Stores `value`, of `bytes` bytes, under `id`, forgetting the oldest entries until
    /// it fits; one larger than the whole budget is not stored (false).
    pub fn insert(&self, id: String, value: T, bytes: usize) -> bool {
        self.insert_at(Instant::now(), id, value, bytes)
    }

    /// The entry stored under `id`, unless it expired, was evicted or deleted.
    pub fn get(&self, id: &str) -> Option<Arc<T>> {
        self.get_at(Instant::now(), id)
    }

    /// Deletes `id`; false if it was not there (or had expired).
    pub fn remove(&self, id: &str) -> bool {
        self.remove_at(Instant::now(), id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        // Every critical section leaves the maps consistent, so a panic elsewhere while
        // holding the lock cannot have broken them.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert_at(&self, now: Instant, id: String, value: T, bytes: usize) -> bool {
        if self.max == 0 || bytes > self.max_bytes {
            return false;
        }
        let mut g = self.lock();
        let Inner {
            live,
            bytes: held,
            order,
        } = &mut *g;
        while let Some((t, _)) = order.front()
            && (now.saturating_duration_since(*t) >= self.ttl
                || live.len() >= self.max
                || *held + bytes > self.max_bytes)
        {
            if let Some((_, old)) = order.pop_front()
                && let Some((_, _, size)) = live.remove(&old)
            {
                *held -= size;
            }
        }
        order.push_back((now, id.clone()));
        if let Some((_, _, size)) = live.insert(id, (now, Arc::new(value), bytes)) {
            *held -= size;
        }
        *held += bytes;
        if order.len() > 2 * self.max {
            order.retain(|(_, id)| live.contains_key(id));
        }
        true
    }

    fn get_at(&self, now: Instant, id: &str) -> Option<Arc<T>> {
        let g = self.lock();
        let (t, v, _) = g.live.get(id)?;
        (now.saturating_duration_since(*t) < self.ttl).then(|| v.clone())
    }

    fn remove_at(&self, now: Instant, id: &str) -> bool {
        let mut g = self.lock();
        let Some((t, _, size)) = g.live.remove(id) else {
            return false;
        };
        g.bytes -= size;
        now.saturating_duration_since(t) < self.ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn get(s: &Store<u32>, now: Instant, id: &str) -> Option<u32> {
        s.get_at(now, id).map(|v| *v)
    }

    #[test]
    fn the_oldest_is_forgotten_first_when_full() {
        let s = Store::new(3, usize::MAX, HOUR);
        let t = Instant::now();
        for i in 0..4 {
            s.insert_at(t, format!("r{i}"), i, 1);
        }
        assert_eq!(get(&s, t, "r0"), None);
        assert_eq!(
            ["r1", "r2", "r3"].map(|id| get(&s, t, id)),
            [Some(1), Some(2), Some(3)]
        );
        // A deleted entry frees its place: nothing else is evicted for the next one.
        assert!(s.remove_at(t, "r2"));
        assert!(!s.remove_at(t, "r2"), "deleted twice");
        s.insert_at(t, "r4".into(), 4, 1);
        assert_eq!(
            ["r1", "r3", "r4"].map(|id| get(&s, t, id)),
            [Some(1), Some(3), Some(4)]
        );
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let s = Store::new(10, usize::MAX, HOUR);
        let t = Instant::now();
        s.insert_at(t, "old".into(), 1, 1);
        s.insert_at(t + HOUR / 2, "new".into(), 2, 1);
        assert_eq!(get(&s, t + HOUR - Duration::from_secs(1), "old"), Some(1));
        assert_eq!(get(&s, t + HOUR, "old"), None);
        assert!(
            !s.remove_at(t + HOUR, "old"),
            "an expired entry is not deleted"
        );
        assert_eq!(get(&s, t + HOUR, "new"), Some(2));
        // A later insert drops what expired from memory too.
        s.insert_at(t + 2 * HOUR, "x".into(), 3, 1);
        assert_eq!(s.lock().live.len(), 1);
    }

    #[test]
    fn a_store_of_size_zero_keeps_nothing_and_deletions_do_not_pile_up() {
        let none = Store::new(0, usize::MAX, HOUR);
        let t = Instant::now();
        none.insert_at(t, "r".into(), 1, 1);
        assert_eq!(get(&none, t, "r"), None);
        let s = Store::new(2, usize::MAX, HOUR);
        for i in 0..100 {
            s.insert_at(t, format!("r{i}"), i, 1);
            assert!(s.remove_at(t, &format!("r{i}")));
        }
        assert!(s.lock().order.len() <= 4);
    }

    #[test]
    fn the_oldest_is_forgotten_first_past_the_byte_budget() {
        let s = Store::new(100, 10, HOUR);
        let t = Instant::now();
        for (i, size) in [4, 4, 2].into_iter().enumerate() {
            assert!(s.insert_at(t, format!("r{i}"), i as u32, size));
        }
        assert!(
            s.insert_at(t, "r3".into(), 3, 5),
            "fits once r0 and r1 are gone"
        );
        assert_eq!(
            ["r0", "r1", "r2", "r3"].map(|id| get(&s, t, id)),
            [None, None, Some(2), Some(3)]
        );
        assert_eq!(s.lock().bytes, 7);
        assert!(
            !s.insert_at(t, "huge".into(), 9, 11),
            "larger than the budget"
        );
        assert_eq!(
            get(&s, t, "r3"),
            Some(3),
            "nothing evicted for what is refused"
        );
        assert!(s.remove_at(t, "r3"));
        assert_eq!(s.lock().bytes, 2);
    }
}
