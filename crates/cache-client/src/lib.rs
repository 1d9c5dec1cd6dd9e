//! The worker's side of the cache service (`services/cache`), in a crate of its own so
//! that workers never depend on the server.
//!
//! [`client`] speaks the cache protocol (`pdmesh.cache.v1`): register with a `KvLayout`,
//! keep the lease alive, look pages up, load and store them, and take part in hand-over
//! rooms ([`rooms`]: the link a worker's hand-overs use, and what it tells its caller of a
//! refused room call); page bytes move over the shared-memory mirror file ([`mirror`]) or
//! inside gRPC messages. [`wire`] converts layouts to and from their protobuf form. [`RemoteTier`]
//! adapts the client to the engine's `HostTier`, whose calls never wait.

pub mod client;
mod lease;
pub mod mirror;
pub mod rooms;
mod tier;
pub mod wire;

pub use lease::{BadLease, Lease};
pub use tier::{OnCorrupt, RemoteTier, TierConfig};

/// What a watchdog does with work stuck past half its deadline: `soft` logs a table of
/// it and counts stalls; `hard` also fails it. The cache service's rooms and a worker's
/// engine loop share the setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Watchdog {
    Off,
    Soft,
    Hard,
}
