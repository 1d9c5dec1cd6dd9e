//! Closed sets of metric label values, declared once as enums ([`label_set!`]) so that
//! the code counting an event and the gateway exporting it agree on every value, and so
//! the gateway can create each series at 0 when it starts (a counter's first event is
//! then an increase, which `increase(...) > 0` sees, instead of a new series).
//!
//! The sets here cross a service boundary: a worker or the cache service counts by them
//! and reports the names over gRPC; the gateway reads them back with `from_name`.

/// Declares an enum of label values with `ALL` (every value, in order), `name` (the
/// label value), `names` and `from_name`. The one list makes both the enum and `ALL`, so a new
/// value cannot be left out of the series created at start.
///
/// ```
/// pdmesh_telemetry::label_set! {
///     /// Which way a door went.
///     pub enum Door { Open => "open", Shut => "shut" }
/// }
/// assert_eq!(Door::ALL, [Door::Open, Door::Shut]);
/// assert_eq!(Door::from_name("shut"), Some(Door::Shut));
/// assert_eq!(Door::names().collect::<Vec<_>>(), ["open", "shut"]);
/// ```
#[macro_export]
macro_rules! label_set {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $label:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$( Self::$variant ),+];

            /// The label value.
            pub const fn name(self) -> &'static str {
                match self {
                    $( Self::$variant => $label ),+
                }
            }

            /// Every label value, in declaration order.
            pub fn names() -> impl Iterator<Item = &'static str> {
                Self::ALL.iter().map(|v| v.name())
            }

            /// The value whose label is `name`, if there is one.
            pub fn from_name(name: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|v| v.name() == name)
            }
        }
    };
}

label_set! {
    /// Why a worker's request failed in a prefill→decode KV transfer
    /// (`mesh_kv_transfer_failures_total{reason}`).
    pub enum TransferFailure {
        /// The room failed: the other side aborted, or a room deadline passed.
        RoomFailed => "room_failed",
        /// This worker's transfer deadline passed.
        Deadline => "deadline",
        CacheUnavailable => "cache_unavailable",
        /// Transferred pages failed their checksum.
        Checksum => "checksum",
        /// The caller went away.
        CallerLeft => "caller_left",
        /// No decode pages became free before the admission deadline.
        Admission => "admission",
        /// Anything else, and a name a newer worker reports that this gateway does not know.
        Other => "other",
    }
}

label_set! {
    /// Why a disk tier page file was discarded instead of served
    /// (`mesh_kv_disk_discards_total{reason}`).
    pub enum DiskDiscard {
        /// Written for another KV layout or model (another model, dtype, page size or
        /// shard).
        ForeignLayout => "foreign_layout",
        /// Shorter or longer than its header says, or than a header.
        Partial => "partial",
        /// The header is not one this version writes, or its own checksum fails.
        BadHeader => "bad_header",
        /// The page's bytes do not match their checksum.
        BadChecksum => "bad_checksum",
        /// The header names another page than the file's name.
        WrongName => "wrong_name",
        /// A temporary file a write left behind (the write never finished).
        Unfinished => "unfinished",
    }
}

label_set! {
    /// Who or what aborted a room at the cache service (`mesh_room_aborts_total{reason}`).
    pub enum RoomAbort {
        /// The prefill side.
        Sender => "sender",
        /// The decode side.
        Receiver => "receiver",
        /// A side's lease expired (its worker stopped heartbeating).
        LeaseLost => "lease_lost",
        /// The cache service's hard-mode watchdog found the room stuck.
        Watchdog => "watchdog",
    }
}

label_set! {
    /// A room's state at the cache service (`mesh_rooms{state}`,
    /// `mesh_room_oldest_seconds{state}`, `mesh_room_timeouts_total{stage}`).
    pub enum RoomState {
        Failed => "failed",
        Bootstrapping => "bootstrapping",
        WaitingForInput => "waiting_for_input",
        Transferring => "transferring",
        Success => "success",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_read_back() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(
            all: &[T],
            name: fn(T) -> &'static str,
            from: fn(&str) -> Option<T>,
        ) {
            let mut names: Vec<_> = all.iter().map(|&v| name(v)).collect();
            for (&v, n) in all.iter().zip(&names) {
                assert_eq!(from(n), Some(v));
            }
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), all.len(), "{names:?}");
        }
        check(
            TransferFailure::ALL,
            TransferFailure::name,
            TransferFailure::from_name,
        );
        check(RoomAbort::ALL, RoomAbort::name, RoomAbort::from_name);
        check(RoomState::ALL, RoomState::name, RoomState::from_name);
        assert_eq!(RoomState::from_name("stuck"), None);
    }
}
