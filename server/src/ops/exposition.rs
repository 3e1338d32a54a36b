//! The metrics listener: `GET /metrics` (HTTP/1.1, plaintext) answers the
//! daemon's registry and the series of its `[[export]]` tables, in the
//! OpenMetrics text format to scrapers that ask for it (Prometheus does),
//! in the Prometheus text format 0.0.4 to the others.

use std::time::{Duration, Instant};

use tokio::{net::TcpListener, sync::watch};

use crate::{export::Exporter, metrics::Metrics};

/// The content type of each exposition format.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the metrics listener serves: the registry, and the exports'
/// series when there are exports.
#[derive(Debug, Clone)]
pub(crate) struct Exposition {
    pub(crate) metrics: Metrics,
    pub(crate) exports: Option<Exporter>,
}

/// One scrape: the formats its scraper accepts (`Accept`), and when it
/// must be answered.
struct Scrape<'a> {
    accept: &'a str,
    deadline: Option<Instant>,
}

impl Exposition {
    /// The exposition `scrape` asks for: OpenMetrics when its `Accept`
    /// names it, else the text format. The exports walk first (by the
    /// scrape's deadline), so that their own figures in the registry are
    /// those of this scrape; their series go before the registry's `# EOF`.
    async fn answer(&self, scrape: Scrape<'_>) -> (&'static str, String) {
        let series = match &self.exports {
            Some(exports) => exports.series(scrape.deadline).await,
            None => String::new(),
        };
        let mut body = self.metrics.encode();
        let at = body.rfind("# EOF").unwrap_or(body.len());
        body.insert_str(at, &series);
        if scrape.accept.contains("application/openmetrics-text") {
            (OPENMETRICS, body)
        } else {
            (TEXT_FORMAT, to_text_format(&body))
        }
    }

    /// Serves `GET /metrics` on `listener` until `stop`.
    pub(crate) async fn serve(self, listener: TcpListener, mut stop: watch::Receiver<bool>) {
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = stop.wait_for(|s| *s) => return,
            };
            match accepted {
                Ok((tcp, _)) => {
                    tokio::spawn(self.clone().connection(tcp));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// Serves one connection (at most 30 s).
    async fn connection(self, tcp: tokio::net::TcpStream) {
        use hyper::{Request, body::Incoming, service::service_fn};
        let service = service_fn(move |req: Request<Incoming>| {
            let this = self.clone();
            async move { Ok::<_, std::convert::Infallible>(this.respond(&req).await) }
        });
        let io = hyper_util::rt::TokioIo::new(tcp);
        let _ = tokio::time::timeout(
            Duration::from_secs(30),
            hyper::server::conn::http1::Builder::new().serve_connection(io, service),
        )
        .await;
    }

    /// The response to one request.
    async fn respond<B>(
        &self,
        req: &hyper::Request<B>,
    ) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
        use http_body_util::Full;
        use hyper::{Response, StatusCode};
        let response = if req.uri().path() == "/metrics" {
            let accept = req
                .headers()
                .get(hyper::header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let scrape = Scrape {
                accept,
                deadline: deadline_of(req),
            };
            let (content_type, body) = self.answer(scrape).await;
            Response::builder()
                .header("content-type", content_type)
                .body(Full::new(bytes::Bytes::from(body)))
        } else {
            Response::builder()
                .status(StatusCode::NOT_FOUND)
                .body(Full::new(bytes::Bytes::from_static(
                    b"metrics are at /metrics\n",
                )))
        };
        response.expect("a valid response")
    }
}

/// When a scrape must be answered: 90 % of the time Prometheus gives it
/// (`X-Prometheus-Scrape-Timeout-Seconds`), if it says.
fn deadline_of<B>(req: &hyper::Request<B>) -> Option<Instant> {
    let seconds: f64 = req
        .headers()
        .get("x-prometheus-scrape-timeout-seconds")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let budget = Duration::try_from_secs_f64(seconds * 0.9).ok()?;
    Instant::now().checked_add(budget)
}

/// The OpenMetrics exposition `om` in the Prometheus text format 0.0.4: a
/// counter's family is named after its `_total` samples, `_created`
/// samples, `# UNIT` and `# EOF` are left out.
pub(crate) fn to_text_format(om: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some(name) = rest.strip_suffix(" counter")
        {
            counters.insert(name.to_owned());
        }
    }
    let created = |sample: &str| {
        let name = sample.split(['{', ' ']).next().unwrap_or(sample);
        name.strip_suffix("_created")
            .is_some_and(|f| counters.contains(f) || om.contains(&format!("# TYPE {f} histogram")))
    };
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF"
            || line.starts_with("# UNIT ")
            || (!line.starts_with('#') && created(line))
        {
            continue;
        }
        let renamed = ["# TYPE ", "# HELP "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}").trim_end().to_owned())
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_becomes_the_text_format() {
        let om = "# HELP reqs Requests.\n# TYPE reqs counter\nreqs_total{a=\"1\"} 3\nreqs_created{a=\"1\"} 1.7e9\n# TYPE up gauge\n# UNIT up seconds\nup 1\n# EOF\n";
        assert_eq!(
            to_text_format(om),
            "# HELP reqs_total Requests.\n# TYPE reqs_total counter\nreqs_total{a=\"1\"} 3\n# TYPE up gauge\nup 1\n"
        );
    }
}
