//! Incident reports, written by the mesh itself.
//!
//! When a room wedges, a page fails its checksum, a layout is refused, an engine loop
//! stalls or an output fails to parse, the component that saw it hands the evidence it
//! holds to a [`Reporter`]: one paragraph of what happened; where (service, host, worker,
//! room, request and trace, with a link to the trace); the room's timeline; both sides'
//! KV layouts side by side with the differences marked; the pages with their expected and
//! found checksums; metrics before and after; the configuration; the stuck rooms; and a
//! replay recipe. The reporter writes it as Markdown for people and JSON for tools into
//! one directory (created owner-only; an existing one must be the service user's and
//! writable by nobody else, else the service refuses to start), keeps at most a bounded
//! number, and deduplicates: the same cause in the same component within a window is one
//! report whose repeat count grows.
//!
//! What it writes never holds a secret: configuration values whose names say key, token,
//! secret or password are replaced, and unless the operator passed
//! `--incident-include-prompts` ([`Config::include_prompts`]) a report keeps only what an
//! allowlist names ([`redact`]): ids, lengths, timings, layouts and fingerprints, error
//! classes and the request's sampling parameters, never the prompt's text or token ids,
//! tool definitions or arguments, system text or the model's output.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

mod args;
mod markdown;

pub use args::IncidentArgs;
pub use markdown::render;

/// What kind of failure a report is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A room stayed in one state past the soft watchdog's threshold.
    Wedge,
    /// A room failed by its deadline (or the hard watchdog).
    RoomDeadline,
    /// Page bytes that did not match their checksum (host tier or hand-over).
    Checksum,
    /// A peer or worker with another KV layout, refused at register or handshake.
    LayoutRefused,
    /// An engine loop that made no progress past its watchdog's threshold.
    EngineStall,
    /// A tool call or reasoning block the parser could not read.
    ToolParse,
    /// Prefill's first token and decode's differ: decode got other KV.
    FirstTokenMismatch,
    /// The disk tier stopped taking pages (a full or unwritable disk, an unreadable
    /// folder): requests go on without it.
    DiskDegraded,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Wedge,
        Kind::RoomDeadline,
        Kind::Checksum,
        Kind::LayoutRefused,
        Kind::EngineStall,
        Kind::ToolParse,
        Kind::FirstTokenMismatch,
        Kind::DiskDegraded,
    ];

    /// The stable name: metric label, file names, JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Wedge => "wedge",
            Kind::RoomDeadline => "room_deadline",
            Kind::Checksum => "checksum",
            Kind::LayoutRefused => "layout_refused",
            Kind::EngineStall => "engine_stall",
            Kind::ToolParse => "tool_parse",
            Kind::FirstTokenMismatch => "first_token_mismatch",
            Kind::DiskDegraded => "disk_degraded",
        }
    }

    /// A report's title.
    pub const fn title(self) -> &'static str {
        match self {
            Kind::Wedge => "Room wedged",
            Kind::RoomDeadline => "Room failed by its deadline",
            Kind::Checksum => "Page checksum failure",
            Kind::LayoutRefused => "KV layout refused",
            Kind::EngineStall => "Engine loop stalled",
            Kind::ToolParse => "Output failed to parse",
            Kind::FirstTokenMismatch => "First token differs between prefill and decode",
            Kind::DiskDegraded => "Disk tier degraded",
        }
    }
}

/// Where it happened.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Place {
    /// The component that saw it: `gateway`, `cache`, `worker`, `tokenizer`.
    pub service: String,
    pub host: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub worker: String,
    /// Where in the component (`host load-back`, `hand-over write`): one cause, so
    /// failures at different stages are separate reports.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stage: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<u64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
    /// The trace in Tempo or Jaeger (the reporter's link template, `{trace_id}` filled).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_link: String,
}

/// One step of a room's (or a request's) life.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// RFC 3339, milliseconds.
    pub at: String,
    pub what: String,
}

impl Step {
    pub fn new(at: SystemTime, what: impl Into<String>) -> Self {
        Self {
            at: timestamp(at),
            what: what.into(),
        }
    }
}

/// A KV layout as the report shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayoutView {
    pub name: String,
    pub fingerprint: String,
    pub layers: usize,
    pub page_size: usize,
    pub components: Vec<ComponentView>,
    /// Bytes per token over every component of one layer.
    pub bytes_per_token_per_layer: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComponentView {
    pub name: String,
    pub dtype: String,
    /// Bytes per token of values, of scales, and both.
    pub value_bytes: usize,
    pub scale_bytes: usize,
    pub bytes_per_token: usize,
}

impl LayoutView {
    pub fn of(l: &pdmesh_kv::KvLayout) -> Self {
        Self {
            name: l.name().to_owned(),
            fingerprint: l.fingerprint_hex(),
            layers: l.layers(),
            page_size: l.page_size(),
            components: l
                .components()
                .iter()
                .map(|c| ComponentView {
                    name: c.name.clone(),
                    dtype: c.dtype.name().to_owned(),
                    value_bytes: c.value_bytes_per_token(),
                    scale_bytes: c.scale_bytes_per_token(),
                    bytes_per_token: c.bytes_per_token(),
                })
                .collect(),
            bytes_per_token_per_layer: l.bytes_per_token_per_layer(),
        }
    }
}

/// Two sides' layouts: this side's and the other's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayoutPair {
    /// Who each side is (`this cache service`, `worker 127.0.0.1:7001`).
    pub ours_label: String,
    pub ours: LayoutView,
    pub theirs_label: String,
    pub theirs: LayoutView,
}

impl LayoutPair {
    /// The differences, one line each (components by name; sizes, dtypes, page size).
    pub fn differences(&self) -> Vec<String> {
        let (a, b) = (&self.ours, &self.theirs);
        let mut out = Vec::new();
        if a.page_size != b.page_size {
            out.push(format!(
                "page size: {} vs {} tokens",
                a.page_size, b.page_size
            ));
        }
        if a.layers != b.layers {
            out.push(format!("layers: {} vs {}", a.layers, b.layers));
        }
        for c in &a.components {
            match b.components.iter().find(|o| o.name == c.name) {
                None => out.push(format!("{}: only on {}", c.name, self.ours_label)),
                Some(o) if o != c => out.push(format!(
                    "{}: {} B/token ({}) vs {} B/token ({})",
                    c.name, c.bytes_per_token, c.dtype, o.bytes_per_token, o.dtype
                )),
                Some(_) => {}
            }
        }
        for o in &b.components {
            if !a.components.iter().any(|c| c.name == o.name) {
                out.push(format!("{}: only on {}", o.name, self.theirs_label));
            }
        }
        out
    }
}

/// A page whose bytes were checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PageCheck {
    /// The page's name where it was checked (its hash, or its index in a transfer).
    pub page: String,
    pub expected: String,
    pub found: String,
}

/// A metric's value before and after the failure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricDelta {
    pub name: String,
    pub before: Option<f64>,
    pub after: Option<f64>,
}

/// A room that was stuck when the report was written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StuckRoom {
    pub room: u64,
    pub state: String,
    pub age_seconds: f64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
}

/// How to run the request again: its body as the gateway got it, with the prompt's text
/// only when the operator allowed it, and the prompt's token ids; and the command that
/// replays it against a reference, where one is known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Replay {
    pub body: serde_json::Value,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_token_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub command: String,
}

/// Everything one report says. Components fill what they know; the reporter fills `id`,
/// the times and the repeat count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Incident {
    #[serde(default)]
    pub id: String,
    pub kind: Kind,
    /// What happened, in one paragraph.
    pub summary: String,
    #[serde(default)]
    pub first_seen: String,
    #[serde(default)]
    pub last_seen: String,
    /// Times the same cause was seen in the same component while this report was open.
    #[serde(default)]
    pub repeats: u64,
    pub place: Place,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<Step>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layouts: Option<LayoutPair>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pages: Vec<PageCheck>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<MetricDelta>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stuck_rooms: Vec<StuckRoom>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<Replay>,
    /// Further evidence by name (the parser and its reason, the tokens seen, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub details: BTreeMap<String, String>,
}

impl Incident {
    pub fn new(kind: Kind, summary: impl Into<String>, place: Place) -> Self {
        Self {
            id: String::new(),
            kind,
            summary: summary.into(),
            first_seen: String::new(),
            last_seen: String::new(),
            repeats: 0,
            place,
            timeline: Vec::new(),
            layouts: None,
            pages: Vec::new(),
            metrics: Vec::new(),
            config: BTreeMap::new(),
            stuck_rooms: Vec::new(),
            replay: None,
            details: BTreeMap::new(),
        }
    }

    /// What makes two reports the same cause in the same component (deduplication).
    fn key(&self) -> (Kind, String) {
        let p = &self.place;
        (
            self.kind,
            format!("{}|{}|{}|{}", p.service, p.host, p.worker, p.stage),
        )
    }
}

/// This machine's host name (for [`Place::host`]).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// RFC 3339 with milliseconds, UTC.
pub fn timestamp(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("incident directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "incident directory {path}: {why}; reports may hold a request's evidence, so the \
         service refuses it: remove it (the service creates it owner-only) or chmod go-w it"
    )]
    Unsafe { path: PathBuf, why: String },
    #[error("incident {0:?} is not a report id")]
    BadId(String),
    #[error("no incident {0:?}")]
    NotFound(String),
    #[error("incident {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Where and how reports are written.
#[derive(Clone, Debug)]
pub struct Config {
    pub dir: PathBuf,
    /// Most reports kept; the oldest go first.
    pub keep: usize,
    /// One report per cause and component within this long; repeats are counted in it.
    pub window: Duration,
    /// A trace link with `{trace_id}` in it (Tempo's or Jaeger's URL), if any.
    pub trace_link: Option<String>,
    /// The mesh's OpenAI endpoint for the replay command (`http://host:port/v1`); unset:
    /// the command's default.
    pub replay_url: Option<String>,
    /// Keep the prompt (text and token ids), tool definitions and arguments and the
    /// model's output in reports (`--incident-include-prompts`); off: [`redact`].
    pub include_prompts: bool,
}

impl Config {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            keep: 200,
            window: Duration::from_secs(300),
            trace_link: None,
            replay_url: None,
            include_prompts: false,
        }
    }
}

/// A report written (or counted): its id, and whether it is new.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filed {
    pub id: String,
    pub path: PathBuf,
    pub new: bool,
}

/// Writes reports (see the crate docs). Shared by a service's components.
#[derive(Debug)]
pub struct Reporter {
    cfg: Config,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    open: HashMap<(Kind, String), Open>,
    seq: u64,
    /// Failures reported, by kind (repeats counted).
    counts: BTreeMap<Kind, u64>,
}

#[derive(Debug)]
struct Open {
    incident: Incident,
    opened: Instant,
    written: Instant,
    /// Repeats not yet in the files.
    unwritten: bool,
}

/// Repeats are written back at most this often (and when the report closes or the
/// reporter is flushed), so a storm of failures is not a storm of writes.
const REWRITE_EVERY: Duration = Duration::from_secs(1);

impl Reporter {
    /// A reporter writing under `cfg.dir`, created now (owner-only) if missing; an
    /// existing directory must be owned by this process's user and writable by nobody
    /// else ([`Error::Unsafe`] otherwise).
    pub fn new(cfg: Config) -> Result<Self, Error> {
        create_dir(&cfg.dir)?;
        check_dir(&cfg.dir)?;
        Ok(Self {
            cfg,
            state: Mutex::new(State::default()),
        })
    }

    /// A service's reporter from its flags: none without `--incident-dir`; an error when
    /// the directory cannot be made or is not safe, which stops the service at start.
    pub fn from_flags(
        dir: Option<&Path>,
        trace_link: Option<String>,
        replay_url: Option<String>,
        include_prompts: bool,
    ) -> Result<Option<Self>, Error> {
        let Some(dir) = dir else {
            return Ok(None);
        };
        let mut cfg = Config::new(dir);
        cfg.trace_link = trace_link;
        cfg.replay_url = replay_url;
        cfg.include_prompts = include_prompts;
        Self::new(cfg).map(Some)
    }

    pub fn dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// Failures reported so far by kind's name, repeats counted (what a service exports
    /// for `mesh_incidents_total`).
    pub fn counts(&self) -> HashMap<String, u64> {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.counts
            .iter()
            .map(|(k, &n)| (k.name().to_owned(), n))
            .collect()
    }

    /// Files `incident`: a new report, or one more repeat of the open report for the same
    /// cause in the same component. The report's path is logged when it is new.
    pub fn report(&self, incident: Incident) -> Result<Filed, Error> {
        let mut incident = if self.cfg.include_prompts {
            incident
        } else {
            redact(incident)
        };
        let now = Instant::now();
        let wall = timestamp(SystemTime::now());
        let key = incident.key();
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *st.counts.entry(incident.kind).or_default() += 1;
        let window = self.cfg.window;
        let closed = st
            .open
            .get(&key)
            .is_some_and(|o| now.duration_since(o.opened) >= window);
        if closed && let Some(o) = st.open.remove(&key) {
            // Its last repeats go into its files before a new report opens.
            if o.unwritten {
                self.write(&o.incident)?;
            }
        }
        if let Some(o) = st.open.get_mut(&key) {
            o.incident.repeats += 1;
            o.incident.last_seen = wall;
            o.unwritten = true;
            merge(&mut o.incident, incident);
            let id = o.incident.id.clone();
            if now.duration_since(o.written) >= REWRITE_EVERY {
                o.written = now;
                o.unwritten = false;
                let snapshot = o.incident.clone();
                drop(st);
                self.write(&snapshot)?;
            }
            return Ok(Filed {
                path: self.cfg.dir.join(format!("{id}.md")),
                id,
                new: false,
            });
        }
        st.seq += 1;
        incident.id = format!(
            "{}-{}-{}-{}",
            wall.replace([':', '-', '.'], ""),
            incident.kind.name(),
            sanitize(&incident.place.service),
            st.seq
        );
        incident.first_seen = wall.clone();
        incident.last_seen = wall;
        incident.repeats = 1;
        incident.config = scrub(std::mem::take(&mut incident.config));
        if let (Some(link), false) = (&self.cfg.trace_link, incident.place.trace_id.is_empty()) {
            incident.place.trace_link = link.replace("{trace_id}", &incident.place.trace_id);
        }
        if let Some(r) = incident.replay.as_mut().filter(|r| r.command.is_empty()) {
            r.command = self.replay_command(&incident.id);
        }
        st.open.insert(
            key,
            Open {
                incident: incident.clone(),
                opened: now,
                written: now,
                unwritten: false,
            },
        );
        drop(st);
        let path = self.write(&incident)?;
        self.prune()?;
        tracing::error!(
            kind = incident.kind.name(),
            report = %path.display(),
            "{}: incident report written",
            incident.kind.title()
        );
        Ok(Filed {
            id: incident.id,
            path,
            new: true,
        })
    }

    /// The command that replays report `id`'s request on the mesh (the API key comes
    /// from `PDMESH_API_KEY`, never from the report).
    fn replay_command(&self, id: &str) -> String {
        let path = self.cfg.dir.join(format!("{id}.json"));
        let mut cmd = format!(
            "pdmesh bench replay {}",
            shell_quote(&path.display().to_string())
        );
        if let Some(url) = &self.cfg.replay_url {
            cmd.push_str(&format!(" --url {}", shell_quote(url)));
        }
        cmd
    }

    /// Writes every open report's repeats not yet in its files.
    pub fn flush(&self) -> Result<(), Error> {
        self.write_pending(Duration::ZERO)
    }

    /// Writes the repeats not yet in their files of reports last written a second ago or
    /// more: call it now and then (a service's housekeeping tick), so a report's count
    /// and evidence catch up without a write per failure.
    pub fn tick(&self) -> Result<(), Error> {
        self.write_pending(REWRITE_EVERY)
    }

    fn write_pending(&self, age: Duration) -> Result<(), Error> {
        let now = Instant::now();
        let pending: Vec<Incident> = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.open
                .values_mut()
                .filter(|o| o.unwritten && now.duration_since(o.written) >= age)
                .map(|o| {
                    o.unwritten = false;
                    o.written = Instant::now();
                    o.incident.clone()
                })
                .collect()
        };
        for i in &pending {
            self.write(i)?;
        }
        Ok(())
    }

    /// The Markdown and JSON files of `i`; the Markdown's path.
    fn write(&self, i: &Incident) -> Result<PathBuf, Error> {
        let dir = &self.cfg.dir;
        let json = dir.join(format!("{}.json", i.id));
        let md = dir.join(format!("{}.md", i.id));
        let body = serde_json::to_vec_pretty(i).map_err(|source| Error::Json {
            path: json.clone(),
            source,
        })?;
        write_private(&json, &body)?;
        write_private(&md, render(i).as_bytes())?;
        Ok(md)
    }

    /// Deletes the oldest reports past `keep`.
    fn prune(&self) -> Result<(), Error> {
        let ids = ids(&self.cfg.dir)?;
        for id in ids.iter().take(ids.len().saturating_sub(self.cfg.keep)) {
            for ext in ["json", "md"] {
                let p = self.cfg.dir.join(format!("{id}.{ext}"));
                if let Err(e) = std::fs::remove_file(&p)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    return Err(io(&p)(e));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "incident reports: last repeats not written");
        }
    }
}

/// Most stuck rooms and pages one report lists.
const MAX_LISTED: usize = 100;

/// A repeat's stuck rooms and pages the open report does not list yet go into it (up to
/// [`MAX_LISTED`]): the report of a wedge that spreads names every room it reached.
fn merge(into: &mut Incident, new: Incident) {
    for r in new.stuck_rooms {
        if into.stuck_rooms.len() < MAX_LISTED && !into.stuck_rooms.iter().any(|o| o.room == r.room)
        {
            into.stuck_rooms.push(r);
        }
    }
    for p in new.pages {
        if into.pages.len() < MAX_LISTED && !into.pages.contains(&p) {
            into.pages.push(p);
        }
    }
}

/// `s` as one word for a POSIX shell (NUL bytes, which no argument can hold, dropped).
fn shell_quote(s: &str) -> String {
    let s = s.replace('\0', "");
    shlex::try_quote(&s)
        .expect("no NUL byte is left")
        .into_owned()
}

/// Configuration values whose names say they are secrets, replaced.
fn scrub(config: BTreeMap<String, String>) -> BTreeMap<String, String> {
    config
        .into_iter()
        .map(|(k, v)| {
            let lower = k.to_ascii_lowercase();
            let secret = ["key", "token", "secret", "password", "credential"]
                .iter()
                .any(|s| lower.contains(s));
            (
                k,
                if secret && !v.is_empty() {
                    "[redacted]".into()
                } else {
                    v
                },
            )
        })
        .collect()
}

fn sanitize(s: &str) -> String {
    let out: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if out.is_empty() { "mesh".into() } else { out }
}

/// Request fields a report keeps without `--incident-include-prompts`: how it sampled
/// and how long it could run, never text it carried.
const BODY_KEPT: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "stream",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "parallel_tool_calls",
];

/// Evidence a report keeps without `--incident-include-prompts`: counts, timings, layouts,
/// error classes and messages the mesh itself wrote. Anything else (the unparsable
/// output's text, `detail`) is dropped.
const DETAILS_KEPT: &[&str] = &[
    "error",
    "failures in this output",
    "idle seconds",
    "metrics before",
    "pages failing",
    "parser",
    "reason",
    "refusal",
    "stalled seconds",
    "this host's layout",
    "watchdog",
];

/// `i` with only what the allowlists keep: every field of [`Incident`] is named here, so a
/// new one is not written until someone decides whether it may hold a request's text.
/// The replay keeps the body's [`BODY_KEPT`] fields with a number, a boolean or (for
/// `model`) a string as value, and loses the prompt's token ids; the details keep
/// [`DETAILS_KEPT`]. What was left out is named (field names, and the prompt's length).
pub fn redact(mut i: Incident) -> Incident {
    let Incident {
        id: _,
        kind: _,
        summary: _,
        first_seen: _,
        last_seen: _,
        repeats: _,
        place: _,
        timeline: _,
        layouts: _,
        pages: _,
        metrics: _,
        config: _,
        stuck_rooms: _,
        replay,
        details,
    } = &mut i;
    let mut dropped: Vec<String> = details
        .keys()
        .filter(|k| !DETAILS_KEPT.contains(&k.as_str()))
        .cloned()
        .collect();
    details.retain(|k, _| DETAILS_KEPT.contains(&k.as_str()));
    *replay = replay.take().map(|r| {
        let mut body = serde_json::Map::new();
        if let serde_json::Value::Object(fields) = r.body {
            for (k, v) in fields {
                let scalar = v.is_number() || v.is_boolean() || (k == "model" && v.is_string());
                if BODY_KEPT.contains(&k.as_str()) && scalar {
                    body.insert(k, v);
                } else {
                    dropped.push(format!("request {k}"));
                }
            }
        }
        if !r.prompt_token_ids.is_empty() {
            details.insert("prompt tokens".into(), r.prompt_token_ids.len().to_string());
            dropped.push("prompt token ids".into());
        }
        Replay {
            body: serde_json::Value::Object(body),
            prompt_token_ids: Vec::new(),
            command: r.command,
        }
    });
    if !dropped.is_empty() {
        details.insert(
            "left out (--incident-include-prompts keeps them)".into(),
            dropped.join(", "),
        );
    }
    i
}

fn create_dir(dir: &Path) -> Result<(), Error> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir).map_err(io(dir))
}

/// Refuses a directory this process's user does not own, or that its group or others
/// may write to (they could plant or replace reports, or links in their place).
fn check_dir(dir: &Path) -> Result<(), Error> {
    let meta = std::fs::metadata(dir).map_err(io(dir))?;
    let unsafe_dir = |why: String| Error::Unsafe {
        path: dir.to_owned(),
        why,
    };
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory".into()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, not by this service's uid {uid}",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "its mode is {mode:04o}: its group or others may write to it"
        )));
    }
    Ok(())
}

/// Writes `bytes` to `path`, owner-only, through a temporary file beside it (a reader
/// never sees half a report). The temporary file is created exclusively and never through
/// a link: whatever is at its name (one a crash left, or a link someone planted) is
/// removed, not followed, and the create tried again.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension()
            .and_then(|e| e.to_str())
            .unwrap_or_default()
    ));
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
    };
    let mut file = match open() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // unlink removes a link itself, never what it points to.
            std::fs::remove_file(&tmp).map_err(io(&tmp))?;
            open()
        }
        other => other,
    }
    .map_err(io(&tmp))?;
    let written = std::io::Write::write_all(&mut file, bytes).map_err(io(&tmp));
    drop(file);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Whether `id` can name a report (and never a path outside the directory).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The ids of the reports in `dir`, oldest first (ids start with their time).
pub fn ids(dir: &Path) -> Result<Vec<String>, Error> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut ids: Vec<String> = rd
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id = name.strip_suffix(".json")?;
            valid_id(id).then(|| id.to_owned())
        })
        .collect();
    ids.sort();
    Ok(ids)
}

/// Report `id` from `dir`.
pub fn read(dir: &Path, id: &str) -> Result<Incident, Error> {
    if !valid_id(id) {
        return Err(Error::BadId(id.to_owned()));
    }
    let path = dir.join(format!("{id}.json"));
    // Never through a link put in the report's place.
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path);
    let bytes = match opened.and_then(|mut f| {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut b).map(|_| b)
    }) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotFound(id.to_owned()));
        }
        Err(e) => return Err(io(&path)(e)),
    };
    serde_json::from_slice(&bytes).map_err(|source| Error::Json { path, source })
}

/// Every report in `dir`, newest first.
pub fn list(dir: &Path) -> Result<Vec<Incident>, Error> {
    let mut out = Vec::new();
    for id in ids(dir)?.iter().rev() {
        match read(dir, id) {
            Ok(i) => out.push(i),
            // Pruned between the listing and the read.
            Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
