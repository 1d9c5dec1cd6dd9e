//! Tensor parallelism for the llama-family model, bit-identical to the unsharded forward
//! for any number of ranks.
//!
//! Megatron-style TP shards a matrix by its input columns and all-reduces partial sums; the
//! order of that sum depends on the number of ranks, so TP=2 would differ from TP=1 in the
//! last bits. Here every matrix is sharded by its OUTPUT rows instead, and ranks exchange
//! whole results with an all-gather: each rank owns a contiguous range of KV heads (and the
//! query heads of those groups), rows of `wo`, of gate/up, of `w_down` and of the output
//! head ([`ShardPlan`]). Every dot product is then computed whole, by the same kernel, on
//! the same inputs as unsharded, so every rank's replicated residual stream — and the
//! logits — carry exactly the bits of TP=1. Per layer a rank computes its q/k/v rows, RoPE,
//! writes its heads' K/V columns into the shared pool and attends for its heads; then
//! all-gather of the attention output → its `wo` rows → all-gather → `x +=`; RMSNorm
//! (replicated) → its gate/up rows, SwiGLU → all-gather → its `w_down` rows → all-gather
//! → `x +=`. The output head is sharded by vocabulary rows and all-gathered; rank 0
//! returns the logits.
//!
//! On the CPU the ranks are scoped threads of one process ([`HostCollective`]) sharing the
//! engine's compute pool; [`ShardPlan`] and [`Collective`] are what a device backend
//! reuses. Each rank counts what its kernels were handed ([`RankWork`], read by
//! `Engine::rank_work`), which is how the tests see that the work was split and not
//! repeated.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError, RwLock};

use pdmesh_kv::PagePool;

use crate::EngineError;
use crate::llama_config::LlamaConfig;

/// `[r*n/world, (r+1)*n/world)` for every rank `r`: contiguous, in order, covering `0..n`
/// exactly once; sizes differ by at most one.
pub fn split(n: usize, world: usize) -> Vec<Range<usize>> {
    (0..world)
        .map(|r| r * n / world..(r + 1) * n / world)
        .collect()
}

/// What one rank computes, in units of the whole model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShard {
    /// KV heads (groups) whose q/k/v, cache columns and attention this rank computes.
    pub kv_heads: Range<usize>,
    /// The query heads of those groups.
    pub q_heads: Range<usize>,
    /// Output rows of `wo` and `w_down` (columns of the residual stream).
    pub dim: Range<usize>,
    /// Output rows of gate and up (columns of the FFN activation).
    pub ffn: Range<usize>,
    /// Rows of the output head (vocabulary entries).
    pub vocab: Range<usize>,
}

impl RankShard {
    /// Everything: the unsharded model as rank 0 of 1.
    pub fn whole(cfg: &LlamaConfig) -> Self {
        Self {
            kv_heads: 0..cfg.kv_heads,
            q_heads: 0..cfg.heads,
            dim: 0..cfg.dim,
            ffn: 0..cfg.ffn,
            vocab: 0..cfg.vocab,
        }
    }
}

/// How a llama-family model is split over `world` ranks: rank `r` gets
/// `split(n, world)[r]` of the KV heads, the dim rows, the FFN rows and the vocabulary, and
/// the query heads of its KV groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: usize,
    pub head_dim: usize,
    pub ranks: Vec<RankShard>,
}

impl ShardPlan {
    /// Fails when `world` is 0 or exceeds the model's KV heads (every rank must own at
    /// least one KV head).
    pub fn new(cfg: &LlamaConfig, world: usize) -> Result<Self, EngineError> {
        if world == 0 {
            return Err(EngineError::InvalidParam {
                field: "tp",
                msg: "tensor parallelism needs at least 1 rank".into(),
            });
        }
        if world > cfg.kv_heads {
            return Err(EngineError::InvalidParam {
                field: "tp",
                msg: format!(
                    "{world} tensor-parallel ranks, but this model has {} KV heads: every \
                     rank needs at least one, so --tp can be at most {}",
                    cfg.kv_heads, cfg.kv_heads
                ),
            });
        }
        let rep = cfg.heads / cfg.kv_heads;
        let (kv, dim, ffn, vocab) = (
            split(cfg.kv_heads, world),
            split(cfg.dim, world),
            split(cfg.ffn, world),
            split(cfg.vocab, world),
        );
        let ranks = (0..world)
            .map(|r| RankShard {
                q_heads: kv[r].start * rep..kv[r].end * rep,
                kv_heads: kv[r].clone(),
                dim: dim[r].clone(),
                ffn: ffn[r].clone(),
                vocab: vocab[r].clone(),
            })
            .collect();
        Ok(Self {
            world,
            head_dim: cfg.head_dim,
            ranks,
        })
    }

    /// Per rank, its columns of an all-gathered `[rows][sum]` block.
    pub fn cols(&self, f: impl Fn(&RankShard) -> usize) -> Vec<usize> {
        self.ranks.iter().map(f).collect()
    }
}

impl fmt::Display for ShardPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, s) in self.ranks.iter().enumerate() {
            if r > 0 {
                f.write_str("; ")?;
            }
            write!(
                f,
                "rank {r}: kv heads {:?}, q heads {:?}, dim {:?}, ffn {:?}, vocab {:?}",
                s.kv_heads, s.q_heads, s.dim, s.ffn, s.vocab
            )?;
        }
        Ok(())
    }
}

/// A piece of the llama forward that a [`ShardPlan`] splits, in units of the whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkKind {
    /// Output rows of `wq` (`heads × head_dim`).
    Q,
    /// Output rows of `wk` (`kv_heads × head_dim`).
    K,
    /// Output rows of `wv` (`kv_heads × head_dim`).
    V,
    /// Columns of the K and V cache rows written (`kv_heads × head_dim`).
    KvWrite,
    /// KV heads attended for.
    Attention,
    /// Output rows of `wo` (`dim`).
    Wo,
    /// Output rows of the FFN gate (`ffn`).
    Gate,
    /// Output rows of the FFN up projection (`ffn`).
    Up,
    /// Output rows of `w_down` (`dim`).
    Down,
    /// Rows of the output head (`vocab`), for the tokens whose logits are wanted.
    Head,
}

impl WorkKind {
    pub const ALL: [WorkKind; 10] = [
        WorkKind::Q,
        WorkKind::K,
        WorkKind::V,
        WorkKind::KvWrite,
        WorkKind::Attention,
        WorkKind::Wo,
        WorkKind::Gate,
        WorkKind::Up,
        WorkKind::Down,
        WorkKind::Head,
    ];

    /// The units of this kind a rank owns under `s` (`RankShard::whole`: all of them).
    pub fn units(self, s: &RankShard, head_dim: usize) -> Range<usize> {
        let heads = |r: &Range<usize>| r.start * head_dim..r.end * head_dim;
        match self {
            WorkKind::Q => heads(&s.q_heads),
            WorkKind::K | WorkKind::V | WorkKind::KvWrite => heads(&s.kv_heads),
            WorkKind::Attention => s.kv_heads.clone(),
            WorkKind::Wo | WorkKind::Down => s.dim.clone(),
            WorkKind::Gate | WorkKind::Up => s.ffn.clone(),
            WorkKind::Head => s.vocab.clone(),
        }
    }
}

/// What one rank computed of one [`WorkKind`], over every forward so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Share {
    /// From the lowest unit (row, column, head) it was handed to past the highest; `None`
    /// before any.
    pub units: Option<Range<usize>>,
    /// Units computed, summed over every token and layer: `units.len()` per token and
    /// layer when every call was handed all of `units`.
    pub computed: u64,
}

/// What one tensor-parallel rank computed over every forward so far, counted where its
/// kernels are handed the work. A model run whole reports one rank owning everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankWork {
    /// Batch tokens through this rank's forwards (every rank runs the whole batch).
    pub tokens: u64,
    pub shares: BTreeMap<WorkKind, Share>,
}

impl RankWork {
    /// The rank's share of `kind` (empty if it computed none).
    pub fn share(&self, kind: WorkKind) -> Share {
        self.shares.get(&kind).cloned().unwrap_or_default()
    }

    /// Counts `units` computed for each of `times` tokens.
    pub(crate) fn add(&mut self, kind: WorkKind, units: Range<usize>, times: usize) {
        if units.is_empty() || times == 0 {
            return;
        }
        self.shares
            .entry(kind)
            .or_default()
            .count(units.clone(), (units.len() * times) as u64);
    }

    /// Adds what `other` (one more forward of the same rank) computed.
    pub(crate) fn merge(&mut self, other: RankWork) {
        self.tokens += other.tokens;
        for (kind, s) in other.shares {
            if let Some(units) = s.units {
                self.shares
                    .entry(kind)
                    .or_default()
                    .count(units, s.computed);
            }
        }
    }
}

impl Share {
    fn count(&mut self, units: Range<usize>, computed: u64) {
        self.computed += computed;
        self.units = Some(match self.units.take() {
            None => units,
            Some(r) => r.start.min(units.start)..r.end.max(units.end),
        });
    }
}

/// Exchange between the ranks of one tensor-parallel group. Every rank calls each
/// collective operation in the same order.
pub trait Collective: Sync {
    fn world(&self) -> usize;

    /// Rank `rank` contributes `local`, a `[rows][cols[rank]]` block; `out` receives every
    /// rank's block side by side in rank order, `[rows][cols.iter().sum()]`.
    fn all_gather(&self, rank: usize, local: &[f32], cols: &[usize], rows: usize, out: &mut [f32]);
}

/// A reusable barrier (mutex and condition variable, as `std::sync::Barrier`) that a rank
/// which panicked can break: everyone waiting then, or arriving later, panics too instead
/// of waiting forever for it.
struct Gate {
    world: usize,
    state: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Default)]
struct GateState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

const BROKEN: &str = "another tensor-parallel rank panicked";

impl Gate {
    fn new(world: usize) -> Self {
        Self {
            world,
            state: Mutex::new(GateState::default()),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Nothing panics while holding the lock: its state is always whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait(&self) {
        let mut s = self.lock();
        let broken = if s.broken {
            true
        } else if s.arrived + 1 == self.world {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            false
        } else {
            s.arrived += 1;
            let generation = s.generation;
            let s = self
                .cv
                .wait_while(s, |s| s.generation == generation && !s.broken)
                .unwrap_or_else(PoisonError::into_inner);
            s.generation == generation
        };
        assert!(!broken, "{BROKEN}");
    }

    fn break_all(&self) {
        self.lock().broken = true;
        self.cv.notify_all();
    }
}

/// [`Collective`] for ranks that are threads of one process: each rank publishes its block
/// in a shared buffer, a barrier, and everyone copies. Two sets of buffers alternate: a
/// rank may write call `n + 2`'s block only after the barrier of call `n + 1`, which every
/// rank reaches only once done reading call `n`, so one barrier per call is enough.
///
/// A rank thread should hold [`HostCollective::abort_on_panic`]'s guard: should it panic,
/// the others are released (with a panic) instead of waiting for it forever.
pub struct HostCollective {
    world: usize,
    gate: Gate,
    /// `[parity][rank]`.
    slots: [Vec<RwLock<Vec<f32>>>; 2],
    /// Per rank, how many gathers it has made.
    calls: Vec<AtomicUsize>,
}

impl HostCollective {
    pub fn new(world: usize) -> Self {
        assert!(world > 0, "a collective needs at least one rank");
        let slots = || (0..world).map(|_| RwLock::new(Vec::new())).collect();
        Self {
            world,
            gate: Gate::new(world),
            slots: [slots(), slots()],
            calls: (0..world).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// A guard for a rank's thread: if the thread unwinds while holding it, every rank
    /// waiting in (or later calling) [`Collective::all_gather`] panics instead of waiting
    /// for it. The collective is then unusable.
    pub fn abort_on_panic(&self) -> AbortOnPanic<'_> {
        AbortOnPanic(self)
    }
}

/// See [`HostCollective::abort_on_panic`].
pub struct AbortOnPanic<'a>(&'a HostCollective);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.gate.break_all();
        }
    }
}

impl Collective for HostCollective {
    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, rank: usize, local: &[f32], cols: &[usize], rows: usize, out: &mut [f32]) {
        assert_eq!(cols.len(), self.world, "one column count per rank");
        assert_eq!(
            local.len(),
            rows * cols[rank],
            "local block is not rows x cols"
        );
        let total: usize = cols.iter().sum();
        assert_eq!(out.len(), rows * total, "output is not rows x total cols");
        // Only this rank's thread touches its counter; the barrier orders the rest.
        let parity = self.calls[rank].fetch_add(1, Ordering::Relaxed) % 2;
        let slots = &self.slots[parity];
        {
            let mut mine = slots[rank].write().expect("a rank panicked mid-gather");
            mine.clear();
            mine.extend_from_slice(local);
        }
        self.gate.wait();
        let mut off = 0;
        for (r, &c) in cols.iter().enumerate() {
            if c > 0 {
                let theirs = slots[r].read().expect("a rank panicked mid-gather");
                for (row, src) in out.chunks_exact_mut(total).zip(theirs.chunks_exact(c)) {
                    row[off..off + c].copy_from_slice(src);
                }
            }
            off += c;
        }
    }
}

/// One rank's place in a tensor-parallel forward.
pub(crate) struct Comm<'a> {
    pub plan: &'a ShardPlan,
    pub rank: usize,
    pub coll: &'a dyn Collective,
}

/// The KV pool as one rank's forward sees it: the engine's pool itself (unsharded), or
/// the pool shared by every rank's thread (each writes only its heads' columns and reads
/// only those, so the lock only serializes access, never orders ranks).
pub(crate) trait KvAccess: Sync {
    fn read<R>(&self, f: impl FnOnce(&PagePool) -> R) -> R;
    fn write<R>(&mut self, f: impl FnOnce(&mut PagePool) -> R) -> R;
}

impl KvAccess for &mut PagePool {
    fn read<R>(&self, f: impl FnOnce(&PagePool) -> R) -> R {
        f(self)
    }
    fn write<R>(&mut self, f: impl FnOnce(&mut PagePool) -> R) -> R {
        f(self)
    }
}

impl KvAccess for &RwLock<&mut PagePool> {
    fn read<R>(&self, f: impl FnOnce(&PagePool) -> R) -> R {
        f(&RwLock::read(self).expect("a rank panicked holding the KV pool"))
    }
    fn write<R>(&mut self, f: impl FnOnce(&mut PagePool) -> R) -> R {
        f(&mut RwLock::write(self).expect("a rank panicked holding the KV pool"))
    }
}

/// A rank's work counts (whole even if a holder panicked: it only adds numbers).
pub(crate) fn lock_work(w: &Mutex<RankWork>) -> MutexGuard<'_, RankWork> {
    w.lock().unwrap_or_else(PoisonError::into_inner)
}
