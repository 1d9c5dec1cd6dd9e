//! Logging and traces for every pdmesh process.
//!
//! Logs go to stderr (`RUST_LOG` filters them). Traces are exported over OTLP/gRPC only
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set;
//! otherwise no exporter, no OpenTelemetry layer and no trace context on the wire exist.
//! A service is `pdmesh-<service>` in traces unless `OTEL_SERVICE_NAME` says otherwise;
//! the exporter's other `OTEL_*` variables (batch delay, headers, timeout) apply as usual.
//!
//! A trace starts at the gateway's HTTP edge (joining a client's `traceparent` if it
//! sent one) and travels as W3C trace context in gRPC metadata: every call made on a
//! request's behalf carries it ([`request`], [`inject`]), and a gRPC server opens a span
//! ([`grpc_server_span`]) only for calls that carry it, so heartbeats, health checks and
//! scrapes never start traces of their own.
//!
//! [`labels`] holds the closed sets of metric label values the services share.

#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

pub use opentelemetry::KeyValue;

pub mod labels;

/// Whether this process exports traces.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The environment variables that turn export on (the OTLP exporter's own).
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// Flushes and stops the trace exporter when dropped. Drop it inside the tokio runtime
/// the process ran on (the exporter's connection lives there).
#[must_use = "dropping the guard stops trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.provider.is_some())
            .finish()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("pdmesh: flushing traces failed: {e}");
        }
    }
}

/// Whether this process exports traces (an OTLP endpoint was given).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

fn endpoint_configured() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Installs the global subscriber: logs to stderr, and with an OTLP endpoint configured
/// and a `service` named, spans exported as `pdmesh-<service>`. Call it inside the tokio
/// runtime (the exporter's gRPC channel is created on it). A subscriber already set (a
/// test harness) is left alone.
pub fn init(service: Option<&str>) -> Telemetry {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    let provider = match service {
        Some(name) if endpoint_configured() => match provider(name) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("pdmesh: traces not exported: {e}");
                None
            }
        },
        _ => None,
    };
    let otel = provider.as_ref().map(|p| {
        // pdmesh's own spans at INFO and above; libraries' internals (h2, hyper, tonic's
        // transport) never reach a trace.
        let targets = Targets::new()
            .with_default(LevelFilter::OFF)
            .with_target("pdmesh", LevelFilter::INFO);
        // Source locations stay (they say which code a span is); thread names, targets
        // and busy/idle times are noise in a trace and cost bytes per span.
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("pdmesh"))
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(targets)
    });
    let installed = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()
        .is_ok();
    ENABLED.store(installed && provider.is_some(), Ordering::Relaxed);
    Telemetry { provider }
}

fn provider(service: &str) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig as _;
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    // The traces-only variable wins, as the OTLP specification says; the exporter reads
    // both itself, this only keeps an empty traces variable from hiding the general one.
    if let Some(ep) = ENDPOINT_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
    {
        builder = builder.with_endpoint(ep);
    }
    let exporter = builder.build()?;
    // OTEL_SERVICE_NAME (read by the resource builder) wins, as the specification says;
    // `pdmesh up` clears it for its children, which name themselves.
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |s| s.trim().is_empty()) {
        resource = resource.with_service_name(format!("pdmesh-{service}"));
    }
    let resource = resource
        .with_attribute(KeyValue::new(
            "service.instance.id",
            format!("{service}-{}", std::process::id()),
        ))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// gRPC metadata as a W3C trace-context carrier.
struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// HTTP headers (and so gRPC metadata, which travels as HTTP/2 headers) as a carrier.
struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes `span`'s trace context into a gRPC request's metadata (nothing when traces are
/// off or the span is not recorded).
pub fn inject_from<T>(span: &Span, req: &mut tonic::Request<T>) {
    if !enabled() {
        return;
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new()
            .inject_context(&cx, &mut MetadataInjector(req.metadata_mut()));
    }
}

/// [`inject_from`] the current span.
pub fn inject<T>(req: &mut tonic::Request<T>) {
    inject_from(&Span::current(), req);
}

/// A gRPC request carrying the current span's trace context.
pub fn request<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    inject(&mut req);
    req
}

/// Makes `span` a child of the trace context in `headers`, if any.
pub fn set_parent_from(span: &Span, headers: &http::HeaderMap) {
    if !enabled() || !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if cx.span().span_context().is_valid() {
        // Fails only without the OpenTelemetry layer, which `enabled` rules out.
        let _ = span.set_parent(cx);
    }
}

/// The span of one gRPC call, for tonic's `Server::trace_fn`: a server span joined to
/// the caller's trace when the call carries trace context, else none at all. Handlers
/// record the fields declared here on `Span::current()`.
pub fn grpc_server_span(req: &http::Request<()>) -> Span {
    if !enabled() || !req.headers().contains_key("traceparent") {
        return Span::none();
    }
    let path = req.uri().path().trim_start_matches('/');
    let (service, method) = path.split_once('/').unwrap_or((path, ""));
    let span = tracing::info_span!(
        target: "pdmesh::grpc",
        "grpc",
        otel.name = path,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        pdmesh.request_id = tracing::field::Empty,
        pdmesh.room = tracing::field::Empty,
        pdmesh.room.state = tracing::field::Empty,
        pdmesh.role = tracing::field::Empty,
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
    );
    set_parent_from(&span, req.headers());
    span
}

/// The 32-hex-digit id of `span`'s trace, when traces are on and it is recorded.
pub fn trace_id(span: &Span) -> Option<String> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Adds an event with attributes to `span` (a no-op when traces are off).
pub fn event(span: &Span, name: impl Into<Cow<'static, str>>, attributes: Vec<KeyValue>) {
    if enabled() {
        span.add_event(name, attributes);
    }
}

/// Renames `span` in its trace (the name a span was created with can only change this
/// way once its context exists; a no-op when traces are off).
pub fn rename(span: &Span, name: impl Into<Cow<'static, str>>) {
    if enabled() {
        span.context().span().update_name(name);
    }
}

/// Marks `span` failed, with a description (a no-op when traces are off).
pub fn fail(span: &Span, description: impl Into<Cow<'static, str>>) {
    if enabled() {
        span.set_status(opentelemetry::trace::Status::error(description));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_survives_a_round_trip_through_metadata_and_headers() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", parent.parse().unwrap());
        let cx = TraceContextPropagator::new().extract(&HeaderExtractor(&headers));
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let mut req = tonic::Request::new(());
        TraceContextPropagator::new()
            .inject_context(&cx, &mut MetadataInjector(req.metadata_mut()));
        assert_eq!(
            req.metadata().get("traceparent").unwrap().to_str().unwrap(),
            parent
        );
    }

    #[test]
    fn without_an_endpoint_nothing_is_injected_and_no_server_span_opens() {
        assert!(!enabled());
        let mut req = request(());
        inject(&mut req);
        assert!(req.metadata().get("traceparent").is_none());
        let http_req = http::Request::builder()
            .uri("/pdmesh.worker.v1.Worker/Generate")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .body(())
            .unwrap();
        assert!(grpc_server_span(&http_req).is_none());
    }
}
