//! The daemon's metrics as the tests and benchmarks read them: one HTTP GET
//! of its metrics listener, and the series by name and labels.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use anyhow::Context as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// One HTTP/1.1 GET of `path` on `addr`, asking for OpenMetrics (as
/// Prometheus does): the status line, the content type and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(String, String, String)> {
    http_get_accepting(
        addr,
        path,
        "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
    )
    .await
}

/// The same with the `Accept` header `accept` (none when empty).
pub async fn http_get_accepting(
    addr: SocketAddr,
    path: &str,
    accept: &str,
) -> anyhow::Result<(String, String, String)> {
    let get = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        let accept = match accept {
            "" => String::new(),
            a => format!("Accept: {a}\r\n"),
        };
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: bpfmapd\r\n{accept}Connection: close\r\n\r\n");
        tcp.write_all(request.as_bytes()).await?;
        let mut raw = String::new();
        tcp.read_to_string(&mut raw).await?;
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(10), get)
        .await
        .context("the metrics listener did not answer within 10 s")??;
    let (head, body) = raw.split_once("\r\n\r\n").context("not an HTTP response")?;
    let status = head.lines().next().unwrap_or_default().to_owned();
    let content_type = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-type"))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_owned()))
}

/// A scrape of `/metrics`: its body.
#[derive(Debug, Clone)]
pub struct Metrics(pub String);

/// Scrapes `/metrics` on `addr` (the metrics listener): a 200 answer in
/// the OpenMetrics text format, whole.
pub async fn try_scrape(addr: SocketAddr) -> anyhow::Result<Metrics> {
    let (status, content_type, body) = http_get(addr, "/metrics").await?;
    anyhow::ensure!(status == "HTTP/1.1 200 OK", "{status}: {body}");
    anyhow::ensure!(
        content_type.starts_with("application/openmetrics-text"),
        "content type {content_type}"
    );
    anyhow::ensure!(body.ends_with("# EOF\n"), "a scrape cut short: {body}");
    Ok(Metrics(body))
}

/// The same; a scrape that fails fails the test.
pub async fn scrape(addr: SocketAddr) -> Metrics {
    try_scrape(addr)
        .await
        .unwrap_or_else(|e| panic!("scraping {addr}: {e:#}"))
}

/// One sample: its name, its labels, its value.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, &'a str)>,
    value: f64,
}

impl Metrics {
    fn samples(&self) -> impl Iterator<Item = Sample<'_>> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (name, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.trim_end_matches('}')),
                    None => (series, ""),
                };
                let labels = labels
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .filter_map(|p| {
                        let (k, v) = p.split_once('=')?;
                        Some((k, v.trim_matches('"')))
                    })
                    .collect();
                Some(Sample {
                    name,
                    labels,
                    value: value.parse().ok()?,
                })
            })
    }

    /// The value of the one series `name` (or `name_total`) whose labels
    /// include `labels`; 0 when there is none (a counter family with no
    /// child yet). Several such series fail the test.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<f64> = self.matching(name, labels).collect();
        assert!(
            found.len() <= 1,
            "{name}{labels:?} matches {} series:\n{}",
            found.len(),
            self.0
        );
        found.first().copied().unwrap_or(0.0)
    }

    /// The sum of the series `name` (or `name_total`) whose labels include
    /// `labels` (every series of that name for none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).sum()
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = f64> + 'a {
        let total = format!("{name}_total");
        self.samples()
            .filter(move |s| {
                (s.name == name || s.name == total) && labels.iter().all(|l| s.labels.contains(l))
            })
            .map(|s| s.value)
    }

    /// Every series by its name and labels as written
    /// (`bpfmapd_reloads_total{result="ok"}`).
    pub fn series(&self) -> BTreeMap<String, f64> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect()
    }
}
