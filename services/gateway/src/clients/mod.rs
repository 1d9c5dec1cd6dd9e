//! The gateway's only contact with the backends: tonic clients for the tokenizer and the
//! worker, and the conversions between their prost types and the gateway's domain types.

pub(crate) mod output;

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use pdmesh_chat::ToolFormat;
use pdmesh_proto::cache::v1::cache_client::CacheClient;
use pdmesh_proto::tokenizer::v1 as tk;
use pdmesh_proto::worker::v1 as wk;
use pdmesh_tls::{AuthChannel, MeshAuth};
use tk::tokenizer_client::TokenizerClient;
use tonic::transport::Endpoint;
use wk::worker_client::WorkerClient;

use self::output::{Detokenizer, Parsing, add_stats, convert_generate, output_parser};
use crate::error::{ApiError, Error};
use crate::metrics::Stage;
use crate::route::Role;

/// What the backends' Health calls say.
#[derive(Debug)]
pub(crate) struct Health {
    pub tokenizer: bool,
    /// Every worker answers ok, and every prefill and decode worker's host is known.
    pub all_workers: bool,
    /// Enough of them do to serve a request: the tokenizer and a unified worker, or a
    /// prefill and a decode worker whose hosts are known.
    pub serving: bool,
    /// Workers that answer ok (and whose host is known), of `workers`.
    pub workers_ok: usize,
    pub workers: usize,
    /// The test-only faults (`--fault-*`) any worker reports, sorted, no repeats.
    pub faults: Vec<String>,
}

/// Each cache service's incident counts by kind, by its URL.
pub(crate) type CacheIncidents =
    std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>;

/// A host's cache service: its URL and a client.
pub(crate) type Cache = (String, CacheClient<AuthChannel>);

/// Connected (lazily) clients for both backends. Cheap to clone: channels are shared.
#[derive(Clone)]
pub(crate) struct Backends {
    tokenizer: TokenizerClient<AuthChannel>,
    /// The cache service of every host, by URL: those given, or those the workers name
    /// as their homes (see [`Backends::learn_cache`]).
    caches: std::sync::Arc<std::sync::RwLock<Vec<Cache>>>,
    /// Every worker, and how requests are spread over them.
    pub(crate) workers: std::sync::Arc<crate::route::Workers>,
    /// The mesh's mutual TLS for every backend connection, if on.
    auth: MeshAuth,
}

/// What the worker reports about the model it serves.
#[derive(Clone, Debug)]
pub(crate) struct WorkerInfo {
    pub model_id: String,
    pub context_length: u32,
    pub vocab_size: u32,
    pub total_pages: u32,
    pub free_pages: u32,
    /// Pages only the worker's prefix cache holds (evictable).
    pub cached_pages: u32,
    /// Cached pages the worker evicted since it started.
    pub evicted_pages: u64,
    /// Prompt tokens the worker served from its device prefix cache since it started.
    pub device_hit_tokens: u64,
    pub host: HostTotals,
    pub pd: PdTotals,
    /// Test-only faults any worker was started with (`--fault-*`), sorted, no repeats.
    pub faults: Vec<String>,
    /// Calls the workers refused for their mesh credential, and whether any runs with
    /// --insecure-plaintext.
    pub auth_refused: u64,
    pub insecure_plaintext: bool,
    /// Failures each worker filed incident reports for, by kind, by worker URL (kept
    /// apart: one worker's restart must not look like every worker's).
    pub incidents: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
}

/// Disaggregation and engine-loop counters, summed over workers.
#[derive(Clone, Debug, Default)]
pub(crate) struct PdTotals {
    pub reserved_pages: u64,
    pub reserved_requests: u64,
    pub running_requests: u64,
    pub waiting_requests: u64,
    pub transfer_bytes: u64,
    pub transfer_seconds: f64,
    pub transfer_failures: std::collections::BTreeMap<String, u64>,
    pub admission_timeouts: u64,
    pub engine_stalls: u64,
    pub watchdog_aborts: u64,
    /// Engine steps, summed (the watchdogs' progress counter).
    pub engine_steps: u64,
    /// Hand-overs the decode side completed, and those that failed there.
    pub transfers_ok: u64,
    pub transfers_failed: u64,
    /// Hand-overs under way and the oldest one's age, by side (prefill, decode).
    pub handovers: std::collections::BTreeMap<Role, (u64, f64)>,
    /// The longest any worker's loop has had work without a step.
    pub engine_idle_seconds: f64,
}

impl PdTotals {
    fn add(&mut self, o: &PdTotals) {
        self.reserved_pages += o.reserved_pages;
        self.reserved_requests += o.reserved_requests;
        self.running_requests += o.running_requests;
        self.waiting_requests += o.waiting_requests;
        self.transfer_bytes += o.transfer_bytes;
        self.transfer_seconds += o.transfer_seconds;
        for (k, v) in &o.transfer_failures {
            *self.transfer_failures.entry(k.clone()).or_default() += v;
        }
        self.admission_timeouts += o.admission_timeouts;
        self.engine_stalls += o.engine_stalls;
        self.watchdog_aborts += o.watchdog_aborts;
        self.engine_steps += o.engine_steps;
        self.transfers_ok += o.transfers_ok;
        self.transfers_failed += o.transfers_failed;
        for (side, (n, oldest)) in &o.handovers {
            let e = self.handovers.entry(*side).or_default();
            e.0 += n;
            e.1 = e.1.max(*oldest);
        }
        self.engine_idle_seconds = self.engine_idle_seconds.max(o.engine_idle_seconds);
    }
}

/// The worker's host-tier counters since it started.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HostTotals {
    pub hit_tokens: u64,
    pub load_bytes: u64,
    pub load_seconds: f64,
    pub written_bytes: u64,
    pub written_seconds: f64,
    pub checksum_failures: u64,
    /// The store queue: pages dropped since start, pages in it now.
    pub dropped_pages: u64,
    pub queued_pages: u64,
    /// Requests fetching their prompt's pages now.
    pub fetching_requests: u64,
}

/// One worker's answer to a cache flush.
#[derive(Clone, Debug)]
pub(crate) struct Flushed {
    pub role: Role,
    pub url: String,
    /// Pages freed, or why the worker did not flush.
    pub pages: Result<u64, ApiError>,
}

/// How long a worker may take to flush its cache (it waits for the engine loop's current
/// step, and under write-back writes pages to the host mirror first).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// One chat message, already flattened to text.
#[derive(Clone, Debug)]
pub(crate) struct Message {
    pub role: String,
    pub content: String,
    /// Assistant turns: the OpenAI `tool_calls` array, as JSON.
    pub tool_calls_json: Option<String>,
    /// Tool turns: the call answered.
    pub tool_call_id: Option<String>,
    /// Assistant turns: `reasoning_content`.
    pub reasoning: Option<String>,
}

/// Sampling parameters, validated by the handlers.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct GenParams {
    pub temperature: f32,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// `None`: up to the context length.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Constrained decoding: the Lark grammar the output must match.
    pub grammar: Option<String>,
    /// Log-probabilities of the generated tokens, with this many alternatives each.
    pub logprobs: Option<u32>,
    /// Added to these tokens' logits (`logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// No end of generation before this many tokens.
    pub min_tokens: u32,
    /// The prompt's log-probabilities, with this many alternatives each (`echo`).
    pub prompt_logprobs: Option<u32>,
    /// Choices to generate (`n`); the handler runs one generation per choice.
    pub n: u32,
    /// The request's body as it came (a reference, not a copy), for an incident report's
    /// replay recipe; only with `--incident-dir`.
    pub request: Option<axum::body::Bytes>,
    /// The name the choices of one `n` > 1 request share, and their number, so the
    /// worker computes their prompt once.
    pub prompt_group: Option<(String, u32)>,
    /// The prefix-cache namespace (`cache_salt`).
    pub cache_salt: Option<String>,
}

/// A generated token's log-probability and its most likely alternatives, as the worker
/// reports them (raw: the model's own distribution).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why the worker ended a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FinishReason {
    Stop,
    Length,
    Abort,
}

/// The worker's final message for a request.
#[derive(Clone, Debug)]
pub(crate) struct Finish {
    pub reason: FinishReason,
    pub matched_stop: Option<String>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub host_cached_tokens: u32,
    pub transferred_tokens: u32,
    /// Seconds in each worker stage (queue, prefill, transfer, decode), 0 when skipped.
    pub stages: [(Stage, f64); 4],
}

/// One message of the worker's Generate stream.
#[derive(Clone, Debug)]
pub(crate) enum WorkerEvent {
    /// Tokens, and the last one's log-probability when the request asked for them.
    Tokens(Vec<u32>, Option<TokenLogprob>),
    /// The prompt's tokens' log-probabilities, from its second token on (asked for with
    /// `prompt_logprobs`); before the first token.
    Prompt(Vec<TokenLogprob>),
    Finished(Finish),
}

pub(crate) type WorkerStream = Pin<Box<dyn Stream<Item = Result<WorkerEvent, ApiError>> + Send>>;

/// How often the gateway pings the backends it streams from (HTTP/2 PING), and how long
/// the answer may take. A backend that vanished without closing its connection (a crashed
/// host, a cut link: no RST ever comes) is noticed within the two, and the calls on that
/// connection fail at once instead of waiting for TCP to give up (minutes). Calls between
/// services carry deadlines of their own.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// See [`KEEPALIVE_INTERVAL`].
pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

fn endpoint(url: &str, auth: &MeshAuth) -> Result<Endpoint, Error> {
    let ep = auth.endpoint(url).map_err(|source| Error::BackendUrl {
        url: url.to_owned(),
        source,
    })?;
    // A stream from a worker has no deadline (it lasts as long as the answer): a worker
    // gone silent is found by the keepalive, and its requests fail UNAVAILABLE.
    Ok(ep
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// A channel to `url` that connects on first use, the credential on every call.
fn lazy(url: &str, auth: &MeshAuth) -> Result<AuthChannel, Error> {
    Ok(auth.channel(endpoint(url, auth)?.connect_lazy()))
}

impl Backends {
    /// Clients that connect on first use (and reconnect after a backend restarts).
    #[cfg(test)]
    pub fn connect_lazy(tokenizer_url: &str, worker_url: &str) -> Result<Self, Error> {
        Self::connect_pd(
            tokenizer_url,
            worker_url,
            (false, &[], &[]),
            pdmesh_tls::test_ca::auth(),
        )
    }

    /// Disaggregated (`pd`): each request goes to one prefill and one decode worker (those
    /// given here, and those DNS finds: [`Backends::discover`]), which meet in a room of
    /// the cache service. Otherwise `worker_url` serves them whole.
    pub fn connect_pd(
        tokenizer_url: &str,
        worker_url: &str,
        (pd, prefill, decode): (bool, &[String], &[String]),
        auth: MeshAuth,
    ) -> Result<Self, Error> {
        let client = |url: &str| Ok::<_, Error>(WorkerClient::new(lazy(url, &auth)?));
        let workers = if !pd {
            crate::route::Workers::unified(worker_url, client(worker_url)?)
        } else {
            let p = prefill
                .iter()
                .map(|u| Ok((u.clone(), client(u)?)))
                .collect::<Result<Vec<_>, Error>>()?;
            let d = decode
                .iter()
                .map(|u| Ok((u.clone(), client(u)?)))
                .collect::<Result<Vec<_>, Error>>()?;
            crate::route::Workers::pd(p, d)
        };
        Ok(Self {
            tokenizer: TokenizerClient::new(lazy(tokenizer_url, &auth)?),
            caches: Default::default(),
            workers: std::sync::Arc::new(workers),
            auth,
        })
    }

    /// Looks up `names` (`host:port`) every `every` until `stop`, and makes the prefill (or
    /// decode) workers found through DNS every address they name. A look-up that fails
    /// (the name is unknown, DNS does not answer) leaves the workers as they were.
    pub fn discover(
        &self,
        prefill: bool,
        names: Vec<String>,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let (workers, auth) = (self.workers.clone(), self.auth.clone());
        let side = if prefill { Role::Prefill } else { Role::Decode }.as_str();
        tokio::spawn(async move {
            loop {
                let mut urls = Vec::new();
                let mut failed = false;
                for name in &names {
                    match tokio::net::lookup_host(name.as_str()).await {
                        Ok(addrs) => urls.extend(addrs.map(|a| format!("http://{a}"))),
                        Err(e) => {
                            tracing::warn!(side, name = %name, error = %e, "DNS look-up failed; the workers stay as they were");
                            failed = true;
                        }
                    }
                }
                if !failed {
                    urls.sort();
                    urls.dedup();
                    let changed = workers.set_discovered(prefill, &urls, |url| {
                        match lazy(url, &auth) {
                            Ok(ch) => Some(WorkerClient::new(ch)),
                            Err(e) => {
                                tracing::warn!(side, url, error = %e, "a discovered worker cannot be dialled");
                                None
                            }
                        }
                    });
                    if !changed.added.is_empty() || !changed.removed.is_empty() {
                        tracing::info!(side, added = ?changed.added, removed = ?changed.removed, "workers found through DNS");
                    }
                }
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = stop.cancelled() => return,
                }
            }
        });
    }

    /// Also read the cache service's state (for `/metrics`).
    pub fn with_cache(self, cache_url: &str) -> Result<Self, Error> {
        self.learn_cache(cache_url)?;
        Ok(self)
    }

    /// Adds the cache service at `cache_url` unless it is already known; returns it when
    /// it is new.
    pub fn learn_cache(&self, cache_url: &str) -> Result<Option<Cache>, Error> {
        let mut caches = self.caches.write().expect("caches lock");
        if caches.iter().any(|(u, _)| u == cache_url) {
            return Ok(None);
        }
        let client = CacheClient::new(lazy(cache_url, &self.auth)?);
        caches.push((cache_url.to_owned(), client.clone()));
        Ok(Some((cache_url.to_owned(), client)))
    }

    /// Every host's cache service, by URL.
    pub fn caches(&self) -> Vec<Cache> {
        self.caches.read().expect("caches lock").clone()
    }

    /// Every host's cache service state summed (the oldest room ages are the oldest of
    /// any host; incident counts are kept by URL, beside), and whether every one of them
    /// answered in time. None without caches.
    pub async fn cache_stats(
        &self,
    ) -> Option<(pdmesh_proto::cache::v1::StatsResponse, bool, CacheIncidents)> {
        let caches = self.caches();
        if caches.is_empty() {
            return None;
        }
        let calls = caches.iter().map(|(url, c)| {
            let mut c = c.clone();
            async move {
                let call = c.stats(pdmesh_proto::cache::v1::StatsRequest {});
                match tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call).await {
                    Ok(Ok(r)) => Some((url.clone(), r.into_inner())),
                    _ => None,
                }
            }
        });
        let got = futures::future::join_all(calls).await;
        let all = got.iter().all(Option::is_some);
        let mut sum = pdmesh_proto::cache::v1::StatsResponse::default();
        let mut incidents = CacheIncidents::new();
        for (url, mut s) in got.into_iter().flatten() {
            incidents.insert(url, std::mem::take(&mut s.incidents).into_iter().collect());
            add_stats(&mut sum, s);
        }
        Some((sum, all, incidents))
    }

    /// What the tokenizer's and every worker's Health calls say.
    pub async fn health(&self) -> Health {
        let mut tok = self.tokenizer.clone();
        let t = tokio::time::timeout(
            crate::route::BACKEND_PROBE_TIMEOUT,
            tok.health(tk::HealthRequest {}),
        );
        // Every worker must answer: a mesh missing one side cannot serve.
        let named = self.workers.named();
        let w = futures::future::join_all(named.iter().map(|(role, t)| {
            let (role, mut c) = (*role, t.client());
            async move {
                let call = c.health(wk::HealthRequest {});
                match tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call).await {
                    Ok(Ok(r)) => {
                        let r = r.into_inner();
                        (role, r.ok, r.faults)
                    }
                    _ => (role, false, Vec::new()),
                }
            }
        }));
        // At once, so a worker that does not answer costs one probe timeout, not two:
        // every worker's health, and its host (learned now where it is not).
        let (t, w, hosts) = tokio::join!(t, w, self.workers.hosts_known());
        let tokenizer = matches!(t, Ok(Ok(r)) if r.get_ref().ok);
        // A prefill or decode worker takes requests only once its host is known.
        let usable: Vec<(Role, bool)> = w
            .iter()
            .zip(&named)
            .map(|((role, ok, _), (_, t))| {
                (*role, *ok && (*role == Role::Unified || t.host_known()))
            })
            .collect();
        let any = |role: Role| usable.iter().any(|&(r, ok)| r == role && ok);
        let mut faults: Vec<String> = w.iter().flat_map(|(_, _, f)| f.clone()).collect();
        faults.sort();
        faults.dedup();
        Health {
            tokenizer,
            all_workers: w.iter().all(|(_, ok, _)| *ok) && hosts,
            serving: tokenizer && (any(Role::Unified) || (any(Role::Prefill) && any(Role::Decode))),
            workers_ok: usable.iter().filter(|(_, ok)| *ok).count(),
            workers: usable.len(),
            faults,
        }
    }

    /// The model's facts (id, context length, vocabulary) from the first worker that
    /// answers ModelInfo: one worker that hangs or is gone holds no request. The workers
    /// serve one model (their KV layouts and the tokenizer's fingerprint are checked).
    pub async fn model_facts(&self) -> Result<WorkerInfo, ApiError> {
        let named = self.workers.named();
        if named.is_empty() {
            return Err(ApiError::unavailable("no worker is known yet"));
        }
        let calls = named.into_iter().map(|(_, t)| {
            Box::pin(async move {
                let mut c = t.client();
                let call = c.model_info(wk::ModelInfoRequest {});
                let r = tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call)
                    .await
                    .map_err(|_| ApiError::unavailable("no worker answered ModelInfo in time"))??;
                Ok::<_, ApiError>(Self::info_of(t.url(), r.into_inner()))
            })
        });
        futures::future::select_ok(calls)
            .await
            .map(|(info, _)| info)
    }

    /// The model's identity from the first worker, with pool and cache counters summed
    /// over every worker.
    pub async fn model_info(&self) -> Result<WorkerInfo, ApiError> {
        let named = self.workers.named();
        if named.is_empty() {
            return Err(ApiError::unavailable("no worker is known yet"));
        }
        let all = futures::future::join_all(named.into_iter().map(|(_, t)| {
            let mut c = t.client();
            async move {
                let url = t.url();
                let call = c.model_info(wk::ModelInfoRequest {});
                let r = tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call)
                    .await
                    .map_err(|_| {
                        ApiError::unavailable("a worker did not answer ModelInfo in time")
                    })??;
                Ok::<_, ApiError>(Self::info_of(url, r.into_inner()))
            }
        }))
        .await;
        let mut infos = all.into_iter().collect::<Result<Vec<_>, _>>()?.into_iter();
        let mut total = infos.next().expect("at least one worker");
        for w in infos {
            total.total_pages += w.total_pages;
            total.free_pages += w.free_pages;
            total.cached_pages += w.cached_pages;
            total.evicted_pages += w.evicted_pages;
            total.device_hit_tokens += w.device_hit_tokens;
            total.host.hit_tokens += w.host.hit_tokens;
            total.host.load_bytes += w.host.load_bytes;
            total.host.load_seconds += w.host.load_seconds;
            total.host.written_bytes += w.host.written_bytes;
            total.host.written_seconds += w.host.written_seconds;
            total.host.checksum_failures += w.host.checksum_failures;
            total.host.dropped_pages += w.host.dropped_pages;
            total.host.queued_pages += w.host.queued_pages;
            total.host.fetching_requests += w.host.fetching_requests;
            total.pd.add(&w.pd);
            total.faults.extend(w.faults);
            total.auth_refused += w.auth_refused;
            total.insecure_plaintext |= w.insecure_plaintext;
            for (url, counts) in w.incidents {
                total.incidents.insert(url, counts);
            }
        }
        total.faults.sort();
        total.faults.dedup();
        Ok(total)
    }

    fn info_of(url: &str, r: wk::ModelInfoResponse) -> WorkerInfo {
        let failed: u64 = r.transfer_failures.values().sum();
        let role = Role::from_wire(&r.role);
        WorkerInfo {
            model_id: r.model_id,
            context_length: r.context_length,
            vocab_size: r.vocab_size,
            total_pages: r.total_pages,
            free_pages: r.free_pages,
            cached_pages: r.cached_pages,
            evicted_pages: r.prefix_evicted_pages,
            device_hit_tokens: r.prefix_hit_tokens,
            auth_refused: r.auth_refused,
            insecure_plaintext: r.insecure_plaintext,
            incidents: [(url.to_owned(), r.incidents.into_iter().collect())].into(),
            host: HostTotals {
                hit_tokens: r.host_hit_tokens,
                load_bytes: r.host_load_bytes,
                load_seconds: r.host_load_seconds,
                written_bytes: r.host_written_bytes,
                written_seconds: r.host_written_seconds,
                checksum_failures: r.host_checksum_failures,
                dropped_pages: r.host_dropped_pages,
                queued_pages: r.host_queued_pages,
                fetching_requests: u64::from(r.host_fetching_requests),
            },
            pd: PdTotals {
                reserved_pages: u64::from(r.reserved_pages),
                reserved_requests: u64::from(r.reserved_requests),
                running_requests: u64::from(r.running_requests),
                waiting_requests: u64::from(r.waiting_requests),
                transfer_bytes: r.transfer_bytes,
                transfer_seconds: r.transfer_seconds,
                transfer_failures: r.transfer_failures.into_iter().collect(),
                admission_timeouts: r.admission_timeouts,
                engine_stalls: r.engine_stalls,
                watchdog_aborts: r.watchdog_aborts,
                engine_steps: r.engine_steps,
                // A hand-over completes when the decode side verified its pages.
                transfers_ok: if role == Some(Role::Decode) {
                    r.transfers
                } else {
                    0
                },
                transfers_failed: if role == Some(Role::Decode) {
                    failed
                } else {
                    0
                },
                handovers: match role {
                    Some(side @ (Role::Prefill | Role::Decode)) => {
                        [(side, (u64::from(r.handovers), r.handover_oldest_seconds))].into()
                    }
                    _ => Default::default(),
                },
                engine_idle_seconds: r.engine_idle_seconds,
            },
            faults: r.faults,
        }
    }

    pub async fn apply_chat_template(
        &self,
        messages: Vec<Message>,
        tools_json: Option<String>,
        thinking: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let req = tk::ChatTemplateRequest {
            messages: messages
                .into_iter()
                .map(|m| tk::ChatMessage {
                    role: m.role.into_bytes(),
                    content: m.content.into_bytes(),
                    tool_calls_json: m
                        .tool_calls_json
                        .map(String::into_bytes)
                        .unwrap_or_default(),
                    tool_call_id: m.tool_call_id.map(String::into_bytes).unwrap_or_default(),
                    reasoning: m.reasoning.map(String::into_bytes).unwrap_or_default(),
                })
                .collect(),
            add_generation_prompt: true,
            tools_json: tools_json.map(String::into_bytes).unwrap_or_default(),
            thinking,
        };
        Ok(self
            .tokenizer
            .clone()
            .apply_chat_template(pdmesh_telemetry::request(req))
            .await?
            .into_inner()
            .ids)
    }

    /// The tokenizer's Info, within the probe timeout.
    async fn tokenizer_info(&self) -> Result<tk::InfoResponse, ApiError> {
        let mut client = self.tokenizer.clone();
        let call = client.info(tk::InfoRequest {});
        Ok(
            tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call)
                .await
                .map_err(|_| ApiError::unavailable("the tokenizer did not answer Info in time"))??
                .into_inner(),
        )
    }

    /// The tool-call markup and reasoning tags the model writes (the tokenizer's Info).
    pub async fn output_format(&self) -> Result<OutputFormat, ApiError> {
        let info = self.tokenizer_info().await?;
        Ok(OutputFormat {
            tools: tool_format_from_wire(info.tool_format()),
            reasoning: info.reasoning,
        })
    }

    pub async fn tokenize(&self, text: String, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let req = tk::TokenizeRequest {
            text: text.into_bytes(),
            add_special_tokens: add_special,
        };
        Ok(self
            .tokenizer
            .clone()
            .tokenize(pdmesh_telemetry::request(req))
            .await?
            .into_inner()
            .ids)
    }

    /// Starts generation; errors the worker reports before its first message (invalid
    /// parameters, prompt too long) come back as `Err`.
    pub async fn generate(
        &self,
        request_id: &str,
        input_ids: Vec<u32>,
        p: GenParams,
    ) -> Result<WorkerStream, ApiError> {
        let sampling = wk::SamplingParams {
            temperature: Some(p.temperature),
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            repetition_penalty: p.repetition_penalty,
            seed: p.seed,
            max_tokens: p.max_tokens.unwrap_or(0),
            stop: p.stop.into_iter().map(String::into_bytes).collect(),
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.is_some(),
            top_logprobs: p.logprobs.unwrap_or(0),
            logit_bias: p.logit_bias.into_iter().collect(),
            min_tokens: p.min_tokens,
            grammar: p.grammar.unwrap_or_default(),
            prompt_logprobs: p.prompt_logprobs,
        };
        let req = wk::GenerateRequest {
            request_id: request_id.to_owned(),
            input_ids,
            sampling: Some(sampling),
            room: 0,
            trace_id: String::new(),
            kv_home: String::new(),
            prompt_group: p
                .prompt_group
                .as_ref()
                .map(|g| g.0.clone())
                .unwrap_or_default(),
            prompt_group_size: p.prompt_group.map_or(0, |g| g.1),
            cache_salt: p.cache_salt,
        };
        let stream = self.workers.generate(req).await?;
        Ok(Box::pin(
            stream
                .map(|item| match item {
                    Ok(msg) => convert_generate(msg),
                    Err(status) => vec![Err(ApiError::from(status))],
                })
                .flat_map(futures::stream::iter),
        ))
    }

    /// Asks the worker to drop `request_id` and free its pages; whether it was running.
    pub async fn abort(&self, request_id: &str) -> Result<bool, ApiError> {
        let req = wk::AbortRequest {
            request_id: request_id.to_owned(),
        };
        // Few workers: ask each (in PD mode both sides hold something).
        let calls = self.workers.all().into_iter().map(|c| {
            let (mut c, req) = (c.clone(), req.clone());
            async move {
                let call = tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, c.abort(req));
                call.await
                    .map_err(|_| ApiError::unavailable("a worker did not answer Abort in time"))?
                    .map(|r| r.into_inner().found)
                    .map_err(ApiError::from)
            }
        });
        let mut found = false;
        for r in futures::future::join_all(calls).await {
            found |= r?;
        }
        Ok(found)
    }

    /// Asks every worker to evict the cached pages no request uses: each worker's role,
    /// URL, and the pages it freed or why it could not.
    pub async fn flush_cache(&self) -> Vec<Flushed> {
        let calls = self.workers.named().into_iter().map(|(role, t)| {
            let mut c = t.client();
            async move {
                let url = t.url();
                let call =
                    tokio::time::timeout(FLUSH_TIMEOUT, c.flush_cache(wk::FlushCacheRequest {}));
                let pages = match call.await {
                    Ok(Ok(r)) => Ok(r.into_inner().pages_flushed),
                    Ok(Err(status)) => Err(ApiError::from(status)),
                    Err(_) => Err(ApiError::unavailable(format!(
                        "no answer within {FLUSH_TIMEOUT:?}"
                    ))),
                };
                Flushed {
                    role,
                    url: url.to_owned(),
                    pages,
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// A streaming detokenizer session (special tokens skipped); `parsing` splits the
    /// text into content, reasoning and tool calls (absent: plain text). With `local`
    /// (a tokenizer whose fingerprint equals the tokenizer service's), the ids are turned
    /// into text in this process by the same code the service runs; otherwise through
    /// the service's Detokenize stream.
    pub fn detokenizer(
        &self,
        parsing: Option<Parsing>,
        local: Option<&pdmesh_tokenize::TextTokenizer>,
        span: tracing::Span,
    ) -> Detokenizer {
        Detokenizer {
            local: local.map(|tok| {
                pdmesh_chat::TextStream::new(tok, true, parsing.as_ref().and_then(output_parser))
            }),
            pushed: false,
            client: self.tokenizer.clone(),
            session: None,
            parsing,
            span,
        }
    }

    /// The tokenizer service's fingerprint (Info), to compare with a local tokenizer's.
    /// The whole text of `ids`, special tokens included (`POST /detokenize`), from the
    /// tokenizer service: one Detokenize stream of one message.
    pub async fn detokenize(&self, ids: Vec<u32>) -> Result<String, ApiError> {
        let msg = tk::DetokenizeRequest {
            ids,
            skip_special_tokens: false,
            ..Default::default()
        };
        let call = pdmesh_telemetry::request(futures::stream::iter([msg]));
        let mut inbound = self.tokenizer.clone().detokenize(call).await?.into_inner();
        let mut text = String::new();
        while let Some(m) = inbound.next().await {
            text.push_str(&m?.text);
        }
        Ok(text)
    }

    pub async fn tokenizer_fingerprint(&self) -> Result<String, ApiError> {
        Ok(self.tokenizer_info().await?.fingerprint)
    }
}

/// A tool-call format as the tokenizer's proto names it (`None`: no tool calls).
pub(super) fn tool_format_to_wire(f: Option<ToolFormat>) -> tk::ToolFormat {
    f.and_then(|f| tk::ToolFormat::from_format_name(f.name()))
        .unwrap_or(tk::ToolFormat::None)
}

/// The tool-call format a proto value names (`None`: no tool calls, or one this
/// gateway does not know).
pub(super) fn tool_format_from_wire(f: tk::ToolFormat) -> Option<ToolFormat> {
    f.format_name().and_then(|n| ToolFormat::from_name(&n))
}

/// The model's output conventions, from the tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OutputFormat {
    /// The tool-call markup the model writes (the tokenizer's `Info.tool_format`); `None`
    /// when it has no chat format for tool calls.
    pub tools: Option<ToolFormat>,
    /// The model writes `<think>…</think>` reasoning.
    pub reasoning: bool,
}

#[cfg(test)]
mod tests;
