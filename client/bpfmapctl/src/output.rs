//! How bpfmapctl prints: JSON Lines, a table, or plain hex, every line with
//! its target; and the progress display on stderr.

use std::io;

use bpfmap_client::{Entry, Target, TargetReport, Value, pb};
use clap::ValueEnum;
use serde_json::{Value as Json, json};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One JSON object per line; keys and values as hex strings.
    Json,
    /// Aligned columns for people.
    Table,
    /// `TARGET KEY VALUE` separated by spaces, hex (per-CPU values joined
    /// by commas): for scripts.
    Hex,
}

/// How per-CPU values are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PerCpu {
    /// One value per CPU.
    List,
    /// The values added up (integers of 1, 2, 4 or 8 bytes, little-endian).
    Sum,
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Appends `bytes` as lowercase hex.
fn push_hex(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 15) as usize] as char);
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::new();
    push_hex(&mut s, bytes);
    s
}

/// Parses a hex key ("0x" allowed).
pub fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    let digits = s.strip_prefix("0x").unwrap_or(s);
    hex::decode(digits).map_err(|e| {
        anyhow::anyhow!("key {s:?} is not a hex string (two hex digits per byte): {e}")
    })
}

/// The sum of per-CPU integer values, in decimal.
fn sum(values: &[Vec<u8>]) -> io::Result<String> {
    let mut total: u128 = 0;
    for v in values {
        let n: u128 = match v.len() {
            1 => u128::from(v[0]),
            2 => u128::from(u16::from_le_bytes([v[0], v[1]])),
            4 => u128::from(u32::from_le_bytes(v[..4].try_into().expect("4 bytes"))),
            8 => u128::from(u64::from_le_bytes(v[..8].try_into().expect("8 bytes"))),
            n => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "--per-cpu sum adds integers of 1, 2, 4 or 8 bytes; this map's values are {n} bytes (use --per-cpu list)"
                    ),
                ));
            }
        };
        total += n;
    }
    Ok(total.to_string())
}

/// A value as text (hex, or per-CPU values joined by commas or summed) and
/// as the JSON fields that carry it.
fn value_text(per_cpu: PerCpu, value: &Value) -> io::Result<(String, Json)> {
    Ok(match value {
        Value::Single(v) => (hex(v), json!({ "value": hex(v) })),
        Value::PerCpu(vs) if per_cpu == PerCpu::Sum => {
            let s = sum(vs)?;
            (s.clone(), json!({ "value_sum": s }))
        }
        Value::PerCpu(vs) => {
            let list: Vec<String> = vs.iter().map(|v| hex(v)).collect();
            (list.join(","), json!({ "per_cpu_values": list }))
        }
    })
}

/// Writes results in one format.
#[derive(Debug)]
pub struct Printer {
    format: Format,
    per_cpu: PerCpu,
    target_width: usize,
    header: bool,
    line: String,
}

impl Printer {
    /// A printer; `target_width` aligns the target column of tables.
    pub fn new(format: Format, per_cpu: PerCpu, target_width: usize) -> Self {
        Self {
            format,
            per_cpu,
            target_width: target_width.max(6),
            header: false,
            line: String::with_capacity(256),
        }
    }

    fn value_text(&self, value: &Value) -> io::Result<(String, Json)> {
        value_text(self.per_cpu, value)
    }

    /// One dump entry.
    pub fn entry(&mut self, out: &mut dyn io::Write, target: &Target, e: &Entry) -> io::Result<()> {
        let per_cpu = self.per_cpu;
        let line = &mut self.line;
        line.clear();
        match self.format {
            Format::Json if matches!(e.value, Value::Single(_)) => {
                // The common case, written directly: no JSON value per entry.
                let Value::Single(v) = &e.value else {
                    unreachable!()
                };
                line.push_str("{\"target\":");
                line.push_str(&serde_json::to_string(target.as_str()).expect("a string"));
                line.push_str(",\"key\":\"");
                push_hex(line, &e.key);
                line.push_str("\",\"value\":\"");
                push_hex(line, v);
                line.push_str("\"}\n");
            }
            Format::Json => {
                let (_, value) = value_text(per_cpu, &e.value)?;
                let mut obj = json!({"target": target.as_str(), "key": hex(&e.key)});
                if let (Some(o), Json::Object(v)) = (obj.as_object_mut(), value) {
                    o.extend(v);
                }
                line.push_str(&obj.to_string());
                line.push('\n');
            }
            Format::Hex => {
                let (value, _) = value_text(per_cpu, &e.value)?;
                line.push_str(target.as_str());
                line.push(' ');
                push_hex(line, &e.key);
                line.push(' ');
                line.push_str(&value);
                line.push('\n');
            }
            Format::Table => {
                let (value, _) = self.value_text(&e.value)?;
                if !self.header {
                    self.header = true;
                    writeln!(
                        out,
                        "{:tw$}  {:kw$}  VALUE",
                        "TARGET",
                        "KEY",
                        tw = self.target_width,
                        kw = e.key.len() * 2
                    )?;
                }
                let line = &mut self.line;
                line.clear();
                line.push_str(&format!(
                    "{:tw$}  {:kw$}  {value}\n",
                    target.as_str(),
                    hex(&e.key),
                    tw = self.target_width,
                    kw = e.key.len() * 2
                ));
            }
        }
        out.write_all(self.line.as_bytes())
    }

    /// A lookup result.
    pub fn lookup(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        r: &pb::LookupResult,
    ) -> io::Result<()> {
        let value = if !r.found {
            None
        } else if r.per_cpu_values.is_empty() {
            Some(Value::Single(r.value.clone()))
        } else {
            Some(Value::PerCpu(r.per_cpu_values.clone()))
        };
        let text = value.as_ref().map(|v| self.value_text(v)).transpose()?;
        match self.format {
            Format::Json => {
                let mut obj =
                    json!({"target": target.as_str(), "key": hex(&r.key), "found": r.found});
                if let (Some(o), Some((_, Json::Object(v)))) = (obj.as_object_mut(), text) {
                    o.extend(v);
                }
                writeln!(out, "{obj}")
            }
            Format::Hex => writeln!(
                out,
                "{} {} {}",
                target,
                hex(&r.key),
                text.map_or("-".to_owned(), |(t, _)| t)
            ),
            Format::Table => {
                if !self.header {
                    self.header = true;
                    writeln!(
                        out,
                        "{:tw$}  {:kw$}  FOUND  VALUE",
                        "TARGET",
                        "KEY",
                        tw = self.target_width,
                        kw = r.key.len() * 2
                    )?;
                }
                writeln!(
                    out,
                    "{:tw$}  {:kw$}  {:5}  {}",
                    target.as_str(),
                    hex(&r.key),
                    if r.found { "yes" } else { "no" },
                    text.map_or(String::new(), |(t, _)| t),
                    tw = self.target_width,
                    kw = r.key.len() * 2
                )
            }
        }
    }

    /// Map descriptions (ListMaps, GetMap).
    pub fn maps(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        maps: &[pb::MapInfo],
    ) -> io::Result<()> {
        for m in maps {
            let method = match pb::DumpMethod::try_from(m.dump_method) {
                Ok(pb::DumpMethod::Batch) => "batch",
                Ok(pb::DumpMethod::KeyByKey) => "key_by_key",
                Ok(pb::DumpMethod::None) => "none",
                _ => "unknown",
            };
            let name = if m.path.is_empty() {
                format!("id:{}", m.id)
            } else {
                m.path.clone()
            };
            match self.format {
                Format::Json => writeln!(
                    out,
                    "{}",
                    json!({
                        "target": target.as_str(),
                        "path": m.path,
                        "id": m.id,
                        "name": m.name,
                        "type": m.type_name,
                        "key_size": m.key_size,
                        "value_size": m.value_size,
                        "max_entries": m.max_entries,
                        "flags": m.flags,
                        "per_cpu": m.per_cpu,
                        "possible_cpus": m.possible_cpus,
                        "btf_id": m.btf_id,
                        "btf_key_type_id": m.btf_key_type_id,
                        "btf_value_type_id": m.btf_value_type_id,
                        "dump_method": method,
                    })
                )?,
                Format::Hex => writeln!(
                    out,
                    "{target} {name} {} {} {} {} {}",
                    m.type_name, m.id, m.key_size, m.value_size, m.max_entries
                )?,
                Format::Table => {
                    if !self.header {
                        self.header = true;
                        writeln!(
                            out,
                            "{:tw$}  {:32}  {:16}  {:>8}  {:>5}  {:>7}  {:>10}",
                            "TARGET",
                            "MAP",
                            "TYPE",
                            "ID",
                            "KEY",
                            "VALUE",
                            "MAX",
                            tw = self.target_width
                        )?;
                    }
                    writeln!(
                        out,
                        "{:tw$}  {name:32}  {:16}  {:>8}  {:>5}  {:>7}  {:>10}",
                        target.as_str(),
                        m.type_name,
                        m.id,
                        m.key_size,
                        m.value_size,
                        m.max_entries,
                        tw = self.target_width
                    )?
                }
            }
        }
        Ok(())
    }
}

/// A progress display on stderr (only when stderr is a terminal): targets
/// done out of all, entries, failures.
#[derive(Debug)]
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    entries: std::cell::Cell<u64>,
    failed: std::cell::Cell<u64>,
}

impl Progress {
    /// A display for `targets` targets, shown if `terminal`.
    pub fn new(terminal: bool, targets: usize) -> Self {
        let bar = terminal.then(|| {
            let bar = indicatif::ProgressBar::new(targets as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} {pos}/{len} targets  {msg}  [{elapsed}]",
                )
                .expect("a valid template"),
            );
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            bar
        });
        Self {
            bar,
            entries: Default::default(),
            failed: Default::default(),
        }
    }

    fn message(&self) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!(
                "{} entries, {} failed",
                self.entries.get(),
                self.failed.get()
            ));
        }
    }

    /// Entries received.
    pub fn entries(&self, n: u64) {
        self.entries.set(self.entries.get() + n);
        self.message();
    }

    /// A target is done.
    pub fn done(&self, report: &TargetReport) {
        if !report.is_ok() {
            self.failed.set(self.failed.get() + 1);
        }
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
        self.message();
    }

    /// Removes the display.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        assert_eq!(unhex("0a0B").unwrap(), [10, 11]);
        assert_eq!(unhex("0x0a").unwrap(), [10]);
        assert_eq!(hex(&[0, 255, 16]), "00ff10");
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn per_cpu_sums_are_exact() {
        let u64s = vec![u64::MAX.to_le_bytes().to_vec(); 4];
        assert_eq!(sum(&u64s).unwrap(), (u128::from(u64::MAX) * 4).to_string());
        assert_eq!(sum(&[vec![1], vec![2]]).unwrap(), "3");
        assert_eq!(sum(&[vec![1, 1], vec![0, 1]]).unwrap(), "513");
        assert!(sum(&[vec![0; 3]]).is_err());
    }

    #[test]
    fn every_format_writes_the_target() {
        let t: Target = "10.0.0.7:50051".parse().unwrap();
        let single = Entry {
            key: vec![1, 2],
            value: Value::Single(vec![0xff]),
        };
        let per_cpu = Entry {
            key: vec![1, 2],
            value: Value::PerCpu(vec![vec![1, 0], vec![2, 0]]),
        };
        let mut out = Vec::new();
        let mut p = Printer::new(Format::Json, PerCpu::List, 0);
        p.entry(&mut out, &t, &single).unwrap();
        p.entry(&mut out, &t, &per_cpu).unwrap();
        let mut sum = Printer::new(Format::Json, PerCpu::Sum, 0);
        sum.entry(&mut out, &t, &per_cpu).unwrap();
        let lines: Vec<Json> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            lines[0],
            json!({"target": "10.0.0.7:50051", "key": "0102", "value": "ff"})
        );
        assert_eq!(
            lines[1],
            json!({"target": "10.0.0.7:50051", "key": "0102", "per_cpu_values": ["0100", "0200"]})
        );
        assert_eq!(
            lines[2],
            json!({"target": "10.0.0.7:50051", "key": "0102", "value_sum": "3"})
        );

        let mut out = Vec::new();
        Printer::new(Format::Hex, PerCpu::List, 0)
            .entry(&mut out, &t, &per_cpu)
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "10.0.0.7:50051 0102 0100,0200\n"
        );

        let mut out = Vec::new();
        let mut table = Printer::new(Format::Table, PerCpu::Sum, t.as_str().len());
        table.entry(&mut out, &t, &per_cpu).unwrap();
        table.entry(&mut out, &t, &single).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "TARGET          KEY   VALUE\n10.0.0.7:50051  0102  3\n10.0.0.7:50051  0102  ff\n"
        );
    }
}
