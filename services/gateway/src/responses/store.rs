//! The gateway's memory of past responses, which `previous_response_id` continues and
//! `GET /v1/responses/{id}` returns. Bounded in count (the oldest is forgotten first) and
//! in age, so a gateway serving for weeks holds at most `--responses-max-stored` of them;
//! in memory only, so a restart forgets them (a later reference is a 404, as for an
//! expired one).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub(crate) struct Store<T> {
    /// Most entries held; 0 holds none.
    max: usize,
    /// How long an entry is found after it was stored.
    ttl: Duration,
    inner: Mutex<Inner<T>>,
}

struct Inner<T> {
    live: HashMap<String, (Instant, Arc<T>)>,
    /// Ids in the order they were stored (which, with one ttl for all, is the order they
    /// expire in); deleted ids linger here until they reach the front or a compaction.
    order: VecDeque<(Instant, String)>,
}

impl<T> Store<T> {
    pub fn new(max: usize, ttl: Duration) -> Self {
        Self {
            max,
            ttl,
            inner: Mutex::new(Inner {
                live: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    pub fn insert(&self, id: String, value: T) {
        self.insert_at(Instant::now(), id, value);
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

    fn insert_at(&self, now: Instant, id: String, value: T) {
        if self.max == 0 {
            return;
        }
        let mut g = self.lock();
        let Inner { live, order } = &mut *g;
        while let Some((t, _)) = order.front()
            && (now.saturating_duration_since(*t) >= self.ttl || live.len() >= self.max)
        {
            if let Some((_, old)) = order.pop_front() {
                live.remove(&old);
            }
        }
        order.push_back((now, id.clone()));
        live.insert(id, (now, Arc::new(value)));
        if order.len() > 2 * self.max {
            order.retain(|(_, id)| live.contains_key(id));
        }
    }

    fn get_at(&self, now: Instant, id: &str) -> Option<Arc<T>> {
        let g = self.lock();
        let (t, v) = g.live.get(id)?;
        (now.saturating_duration_since(*t) < self.ttl).then(|| v.clone())
    }

    fn remove_at(&self, now: Instant, id: &str) -> bool {
        let mut g = self.lock();
        matches!(g.live.remove(id), Some((t, _)) if now.saturating_duration_since(t) < self.ttl)
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
        let s = Store::new(3, HOUR);
        let t = Instant::now();
        for i in 0..4 {
            s.insert_at(t, format!("r{i}"), i);
        }
        assert_eq!(get(&s, t, "r0"), None);
        assert_eq!(
            ["r1", "r2", "r3"].map(|id| get(&s, t, id)),
            [Some(1), Some(2), Some(3)]
        );
        // A deleted entry frees its place: nothing else is evicted for the next one.
        assert!(s.remove_at(t, "r2"));
        assert!(!s.remove_at(t, "r2"), "deleted twice");
        s.insert_at(t, "r4".into(), 4);
        assert_eq!(
            ["r1", "r3", "r4"].map(|id| get(&s, t, id)),
            [Some(1), Some(3), Some(4)]
        );
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let s = Store::new(10, HOUR);
        let t = Instant::now();
        s.insert_at(t, "old".into(), 1);
        s.insert_at(t + HOUR / 2, "new".into(), 2);
        assert_eq!(get(&s, t + HOUR - Duration::from_secs(1), "old"), Some(1));
        assert_eq!(get(&s, t + HOUR, "old"), None);
        assert!(
            !s.remove_at(t + HOUR, "old"),
            "an expired entry is not deleted"
        );
        assert_eq!(get(&s, t + HOUR, "new"), Some(2));
        // A later insert drops what expired from memory too.
        s.insert_at(t + 2 * HOUR, "x".into(), 3);
        assert_eq!(s.lock().live.len(), 1);
    }

    #[test]
    fn a_store_of_size_zero_keeps_nothing_and_deletions_do_not_pile_up() {
        let none = Store::new(0, HOUR);
        let t = Instant::now();
        none.insert_at(t, "r".into(), 1);
        assert_eq!(get(&none, t, "r"), None);
        let s = Store::new(2, HOUR);
        for i in 0..100 {
            s.insert_at(t, format!("r{i}"), i);
            assert!(s.remove_at(t, &format!("r{i}")));
        }
        assert!(s.lock().order.len() <= 4);
    }
}
