//! How bpfmapctl prints: JSON Lines, a table, or plain hex, every line with
//! its target; and the progress display on stderr.

use std::io;

use bpfmap_client::{
    EntryRef, LookupResult, MapInfo, MapTypes, PerCpuValues, Target, TargetReport, ValueRef,
    typed::{JsonWriter, write_json_string},
};
use clap::ValueEnum;
use serde_json::{Value as Json, json};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// One JSON object per line: keys and values decoded when the map has
    /// types (BTF), hex strings otherwise.
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
    /// The values added up: every integer member of a typed value, or an
    /// untyped value of 1, 2, 4 or 8 bytes (little-endian).
    Sum,
}

impl From<PerCpu> for bpfmap_client::PerCpu {
    fn from(p: PerCpu) -> Self {
        match p {
            PerCpu::Sum => Self::Sum,
            PerCpu::List => Self::Each,
        }
    }
}

/// Appends `bytes` as lowercase hex.
fn push_hex(out: &mut Vec<u8>, bytes: &[u8]) {
    let start = out.len();
    out.resize(start + bytes.len() * 2, 0);
    faster_hex::hex_encode(bytes, &mut out[start..]).expect("room for two digits per byte");
}

fn hex(bytes: &[u8]) -> String {
    faster_hex::hex_string(bytes)
}

/// The sum of per-CPU integer values, in decimal.
fn sum(values: PerCpuValues<'_>) -> io::Result<String> {
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
fn value_text(per_cpu: PerCpu, value: ValueRef<'_>) -> io::Result<(String, Json)> {
    Ok(match value {
        ValueRef::Single(v) => (hex(v), json!({ "value": hex(v) })),
        ValueRef::PerCpu(vs) if per_cpu == PerCpu::Sum => {
            let s = sum(vs)?;
            (s.clone(), json!({ "value_sum": s }))
        }
        ValueRef::PerCpu(vs) => {
            let list: Vec<String> = vs.iter().map(hex).collect();
            (list.join(","), json!({ "per_cpu_values": list }))
        }
    })
}

/// Writes results in one format.
#[derive(Debug)]
pub(crate) struct Printer {
    format: Format,
    per_cpu: PerCpu,
    target_width: usize,
    header: bool,
    /// The line being written.
    line: Vec<u8>,
    /// Typed table columns: (name, width), set by the first typed row.
    columns: Vec<(String, usize)>,
    /// The last target written, and `"target":"..",` for JSON lines.
    target: Option<(Target, Vec<u8>)>,
    /// A decoded value's JSON text.
    value: Vec<u8>,
}

/// A decoded value as a table cell: strings bare, the rest as JSON.
pub(crate) fn cell(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::StringValue(s)) => s.clone(),
        _ => {
            let mut out = Vec::new();
            write_value(v, &mut out);
            String::from_utf8_lossy(&out).into_owned()
        }
    }
}

/// A `google.protobuf.Value` as JSON text.
pub(crate) fn write_value(v: &prost_types::Value, out: &mut Vec<u8>) {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => out.extend_from_slice(b"null"),
        Some(Kind::BoolValue(b)) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => {
            out.extend_from_slice((*n as i64).to_string().as_bytes())
        }
        Some(Kind::NumberValue(n)) => out.extend_from_slice(format!("{n:?}").as_bytes()),
        Some(Kind::StringValue(s)) => write_json_string(out, s),
        Some(Kind::ListValue(l)) => {
            out.push(b'[');
            for (i, x) in l.values.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(x, out);
            }
            out.push(b']');
        }
        Some(Kind::StructValue(s)) => {
            out.push(b'{');
            for (i, (k, x)) in s.fields.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json_string(out, k);
                out.push(b':');
                write_value(x, out);
            }
            out.push(b'}');
        }
    }
}

/// The cells of a decoded key or value: one per member of a struct or
/// union (named by the layout, in declaration order), else one.
fn cells(
    layout: &bpfmap_client::typed::Layout,
    v: &prost_types::Value,
    fallback: &str,
) -> Vec<(String, String)> {
    use prost_types::value::Kind;
    let names = layout.member_names();
    match &v.kind {
        Some(Kind::StructValue(s)) if !names.is_empty() => names
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    s.fields.get(*n).map(cell).unwrap_or_default(),
                )
            })
            .collect(),
        _ => vec![(fallback.to_owned(), cell(v))],
    }
}

impl Printer {
    /// The format it writes.
    pub(crate) fn format(&self) -> Format {
        self.format
    }

    /// A printer; `target_width` aligns the target column of tables.
    pub(crate) fn new(format: Format, per_cpu: PerCpu, target_width: usize) -> Self {
        Self {
            format,
            per_cpu,
            target_width: target_width.max(6),
            header: false,
            line: Vec::with_capacity(256),
            columns: Vec::new(),
            target: None,
            value: Vec::with_capacity(256),
        }
    }

    /// Starts a JSON line for `target`: `{"target":"...",`; the target's
    /// escaping is kept from one line to the next.
    fn start_json_line(&mut self, target: &Target) {
        if self.target.as_ref().is_none_or(|(t, _)| t != target) {
            let mut prefix = b"{\"target\":".to_vec();
            write_json_string(&mut prefix, target.as_str());
            prefix.push(b',');
            self.target = Some((target.clone(), prefix));
        }
        self.line.clear();
        if let Some((_, prefix)) = &self.target {
            self.line.extend_from_slice(prefix);
        }
    }

    /// A decoded value as JSON text: per CPU, or summed.
    fn typed_value(
        per_cpu: PerCpu,
        types: &MapTypes,
        value: ValueRef<'_>,
        out: &mut Vec<u8>,
    ) -> io::Result<&'static str> {
        let field = match value {
            ValueRef::Single(v) => {
                types.value().write_json(v, out);
                "value"
            }
            ValueRef::PerCpu(_) if per_cpu == PerCpu::Sum => {
                types
                    .render_sum(value, &mut JsonWriter::new(out))
                    .map_err(|e| {
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!("--per-cpu sum: {e} (use --per-cpu list)"),
                        )
                    })?;
                "value_sum"
            }
            ValueRef::PerCpu(_) => {
                types.render_value(value, &mut JsonWriter::new(out));
                "per_cpu_values"
            }
        };
        Ok(field)
    }

    /// A row of a typed table: the target, then the key's and the value's
    /// members (or KEY / VALUE for types that are not records); the header
    /// comes from the first row.
    fn typed_row(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        types: &MapTypes,
        key: &[u8],
        found: Option<bool>,
        value: Option<ValueRef<'_>>,
    ) -> io::Result<()> {
        let mut row = cells(types.key(), &types.decode_key(key), "KEY");
        if let Some(found) = found {
            row.push(("FOUND".into(), if found { "yes" } else { "no" }.into()));
        }
        match value {
            Some(v @ ValueRef::PerCpu(_)) if self.per_cpu == PerCpu::Sum => {
                let sum = types.sum_value(v).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("--per-cpu sum: {e} (use --per-cpu list)"),
                    )
                })?;
                row.extend(cells(types.value(), &sum, "VALUE"));
            }
            Some(v @ ValueRef::PerCpu(_)) => {
                row.push(("PER_CPU_VALUES".into(), cell(&types.decode_value(v))));
            }
            Some(v) => row.extend(cells(types.value(), &types.decode_value(v), "VALUE")),
            None => {}
        }
        if !self.header {
            self.header = true;
            self.columns = row
                .iter()
                .map(|(name, text)| (name.clone(), name.len().max(text.len())))
                .collect();
            let mut line = format!("{:tw$}", "TARGET", tw = self.target_width);
            for (name, width) in &self.columns {
                line.push_str(&format!("  {name:width$}"));
            }
            writeln!(out, "{}", line.trim_end())?;
        }
        let mut line = format!("{:tw$}", target.as_str(), tw = self.target_width);
        for (i, (_, text)) in row.iter().enumerate() {
            let width = self.columns.get(i).map_or(0, |c| c.1);
            line.push_str(&format!("  {text:width$}"));
        }
        writeln!(out, "{}", line.trim_end())
    }

    /// One dump entry, decoded through `types` when given.
    pub(crate) fn typed_entry(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        e: EntryRef<'_>,
        types: Option<&MapTypes>,
    ) -> io::Result<()> {
        let Some(types) = types.filter(|_| self.format != Format::Hex) else {
            return self.entry(out, target, e);
        };
        match self.format {
            Format::Table => self.typed_row(out, target, types, e.key, None, Some(e.value)),
            _ => {
                self.value.clear();
                let field = Self::typed_value(self.per_cpu, types, e.value, &mut self.value)?;
                self.start_json_line(target);
                let line = &mut self.line;
                line.extend_from_slice(b"\"key\":");
                types.key().write_json(e.key, line);
                line.extend_from_slice(b",\"");
                line.extend_from_slice(field.as_bytes());
                line.extend_from_slice(b"\":");
                line.extend_from_slice(&self.value);
                line.extend_from_slice(b"}\n");
                out.write_all(line)
            }
        }
    }

    /// A lookup result, decoded through `types` when given.
    pub(crate) fn typed_lookup(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        r: &LookupResult,
        types: Option<&MapTypes>,
    ) -> io::Result<()> {
        let Some(types) = types.filter(|_| self.format != Format::Hex) else {
            return self.lookup(out, target, r);
        };
        let value = r.value();
        match self.format {
            Format::Table => self.typed_row(out, target, types, r.key(), Some(r.found()), value),
            _ => {
                let mut json = Vec::new();
                json.extend_from_slice(b"{\"target\":");
                write_json_string(&mut json, target.as_str());
                json.extend_from_slice(b",\"key\":");
                types.key().write_json(r.key(), &mut json);
                json.extend_from_slice(if r.found() {
                    b",\"found\":true" as &[u8]
                } else {
                    b",\"found\":false"
                });
                if let Some(v) = value {
                    let mut text = Vec::new();
                    let field = Self::typed_value(self.per_cpu, types, v, &mut text)?;
                    json.extend_from_slice(b",\"");
                    json.extend_from_slice(field.as_bytes());
                    json.extend_from_slice(b"\":");
                    json.extend_from_slice(&text);
                }
                json.extend_from_slice(b"}\n");
                out.write_all(&json)
            }
        }
    }

    fn value_text(&self, value: ValueRef<'_>) -> io::Result<(String, Json)> {
        value_text(self.per_cpu, value)
    }

    /// One dump entry, written straight into the line (no JSON value or
    /// string per entry).
    pub(crate) fn entry(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        e: EntryRef<'_>,
    ) -> io::Result<()> {
        match self.format {
            Format::Json => self.json_entry(target, e)?,
            Format::Hex => self.hex_entry(target, e)?,
            Format::Table => self.table_entry(out, target, e)?,
        }
        out.write_all(&self.line)
    }

    /// `{"target":..,"key":"..","value":".."}` (or `"per_cpu_values"`,
    /// `"value_sum"`) into the line.
    fn json_entry(&mut self, target: &Target, e: EntryRef<'_>) -> io::Result<()> {
        self.start_json_line(target);
        let line = &mut self.line;
        line.extend_from_slice(b"\"key\":\"");
        push_hex(line, e.key);
        match e.value {
            ValueRef::Single(v) => {
                line.extend_from_slice(b"\",\"value\":\"");
                push_hex(line, v);
                line.push(b'"');
            }
            ValueRef::PerCpu(vs) if self.per_cpu == PerCpu::Sum => {
                line.extend_from_slice(b"\",\"value_sum\":\"");
                line.extend_from_slice(sum(vs)?.as_bytes());
                line.push(b'"');
            }
            ValueRef::PerCpu(vs) => {
                line.extend_from_slice(b"\",\"per_cpu_values\":[");
                for (i, v) in vs.iter().enumerate() {
                    if i > 0 {
                        line.push(b',');
                    }
                    line.push(b'"');
                    push_hex(line, v);
                    line.push(b'"');
                }
                line.push(b']');
            }
        }
        line.extend_from_slice(b"}\n");
        Ok(())
    }

    /// `TARGET KEY VALUE` into the line.
    fn hex_entry(&mut self, target: &Target, e: EntryRef<'_>) -> io::Result<()> {
        let line = &mut self.line;
        line.clear();
        line.extend_from_slice(target.as_str().as_bytes());
        line.push(b' ');
        push_hex(line, e.key);
        line.push(b' ');
        match e.value {
            ValueRef::Single(v) => push_hex(line, v),
            ValueRef::PerCpu(vs) if self.per_cpu == PerCpu::Sum => {
                line.extend_from_slice(sum(vs)?.as_bytes());
            }
            ValueRef::PerCpu(vs) => {
                for (i, v) in vs.iter().enumerate() {
                    if i > 0 {
                        line.push(b',');
                    }
                    push_hex(line, v);
                }
            }
        }
        line.push(b'\n');
        Ok(())
    }

    /// A table row into the line (the header first, to `out`).
    fn table_entry(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        e: EntryRef<'_>,
    ) -> io::Result<()> {
        let (value, _) = self.value_text(e.value)?;
        let (tw, kw) = (self.target_width, e.key.len() * 2);
        if !self.header {
            self.header = true;
            writeln!(out, "{:tw$}  {:kw$}  VALUE", "TARGET", "KEY")?;
        }
        self.line.clear();
        let row = format!("{:tw$}  {:kw$}  {value}\n", target.as_str(), hex(e.key));
        self.line.extend_from_slice(row.as_bytes());
        Ok(())
    }

    /// A lookup result.
    pub(crate) fn lookup(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        r: &LookupResult,
    ) -> io::Result<()> {
        let text = r.value().map(|v| self.value_text(v)).transpose()?;
        let key = hex(r.key());
        match self.format {
            Format::Json => {
                let mut obj = json!({"target": target.as_str(), "key": key, "found": r.found()});
                if let (Some(o), Some((_, Json::Object(v)))) = (obj.as_object_mut(), text) {
                    o.extend(v);
                }
                writeln!(out, "{obj}")
            }
            Format::Hex => {
                let value = text.map_or("-".to_owned(), |(t, _)| t);
                writeln!(out, "{target} {key} {value}")
            }
            Format::Table => {
                let (tw, kw) = (self.target_width, key.len());
                if !self.header {
                    self.header = true;
                    writeln!(out, "{:tw$}  {:kw$}  FOUND  VALUE", "TARGET", "KEY")?;
                }
                let found = if r.found() { "yes" } else { "no" };
                let value = text.map_or(String::new(), |(t, _)| t);
                writeln!(
                    out,
                    "{:tw$}  {key:kw$}  {found:5}  {value}",
                    target.as_str()
                )
            }
        }
    }

    /// Map descriptions (ListMaps, GetMap).
    pub(crate) fn maps(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        maps: &[MapInfo],
    ) -> io::Result<()> {
        for m in maps {
            match self.format {
                Format::Json => writeln!(out, "{}", map_json(target, m))?,
                Format::Hex => writeln!(
                    out,
                    "{target} {} {} {} {} {} {}",
                    m.map_name(),
                    m.type_name(),
                    m.id(),
                    m.key_size(),
                    m.value_size(),
                    m.max_entries()
                )?,
                Format::Table => self.map_row(out, target, m)?,
            }
        }
        Ok(())
    }

    /// A map as a table row (the header first).
    fn map_row(&mut self, out: &mut dyn io::Write, target: &Target, m: &MapInfo) -> io::Result<()> {
        let tw = self.target_width;
        if !self.header {
            self.header = true;
            writeln!(
                out,
                "{:tw$}  {:32}  {:15}  {:16}  {:>8}  {:>5}  {:>7}  {:>10}  OWNERS",
                "TARGET", "MAP", "NAME", "TYPE", "ID", "KEY", "VALUE", "MAX",
            )?;
        }
        writeln!(
            out,
            "{:tw$}  {:32}  {:15}  {:16}  {:>8}  {:>5}  {:>7}  {:>10}  {}",
            target.as_str(),
            m.map_name().to_string(),
            m.name(),
            m.type_name(),
            m.id(),
            m.key_size(),
            m.value_size(),
            m.max_entries(),
            owners_text(m),
        )
    }
}

/// Who holds a map, for a table: its processes (`comm[pid]`), else its
/// programs (`prog NAME`), else `-`.
fn owners_text(m: &MapInfo) -> String {
    let processes = m.owners().iter().map(|o| format!("{}[{}]", o.comm, o.pid));
    let programs = m.programs().iter().map(|p| format!("prog {}", p.name));
    let all: Vec<String> = if m.owners().is_empty() {
        programs.collect()
    } else {
        processes.collect()
    };
    if all.is_empty() {
        "-".to_owned()
    } else {
        all.join(",")
    }
}

/// A map as a JSON line: everything GetMap says about it.
fn map_json(target: &Target, m: &MapInfo) -> Json {
    let types = match m.types() {
        Ok(Some(t)) => json!(t.to_string()),
        Ok(None) => match m.types_unavailable() {
            Some(why) => json!(format!("unavailable: {why}")),
            None => Json::Null,
        },
        Err(e) => json!(format!("unusable: {e}")),
    };
    let p = m.as_proto();
    json!({
        "target": target.as_str(),
        "path": p.path,
        "id": m.id(),
        "name": m.name(),
        "type": m.type_name(),
        "key_size": m.key_size(),
        "value_size": m.value_size(),
        "max_entries": m.max_entries(),
        "flags": m.flags(),
        "per_cpu": m.per_cpu(),
        "possible_cpus": m.possible_cpus(),
        "btf_id": p.btf_id,
        "btf_key_type_id": p.btf_key_type_id,
        "btf_value_type_id": p.btf_value_type_id,
        "dump_method": m.dump_method().as_str(),
        "types": types,
        "render": p.render.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "pins": m.pins(),
        "programs": m.programs().iter().map(|p| json!({"id": p.id, "name": p.name, "type": p.r#type})).collect::<Vec<_>>(),
        "owners": m.owners().iter().map(|o| json!({"pid": o.pid, "comm": o.comm})).collect::<Vec<_>>(),
        "memlock": m.memlock(),
        "holders_incomplete": m.holders_incomplete(),
    })
}

/// A progress display on stderr (only when stderr is a terminal): targets
/// done out of all, entries, failures.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    entries: std::cell::Cell<u64>,
    failed: std::cell::Cell<u64>,
}

impl Progress {
    /// A display for `targets` targets, shown if `terminal`.
    pub(crate) fn new(terminal: bool, targets: usize) -> Self {
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
    pub(crate) fn entries(&self, n: u64) {
        self.entries.set(self.entries.get() + n);
        self.message();
    }

    /// A target is done.
    pub(crate) fn done(&self, report: &TargetReport) {
        if !report.is_ok() {
            self.failed.set(self.failed.get() + 1);
        }
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
        self.message();
    }

    /// Says `line` on stderr, above the display if there is one.
    pub(crate) fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Removes the display.
    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use bpfmap_client::{Entry, Value};

    use super::*;

    #[test]
    fn hex_is_two_lowercase_digits_per_byte() {
        assert_eq!(hex(&[0, 255, 16]), "00ff10");
        // Every byte, at lengths that take each path of the encoder (short
        // inputs and the vector ones), appended after what the line holds.
        let all: Vec<u8> = (0..=255).collect();
        for n in [0, 1, 7, 8, 15, 16, 31, 32, 33, 64, 256] {
            let mut line = b"x ".to_vec();
            push_hex(&mut line, &all[..n]);
            let want: String = all[..n].iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(
                line,
                [b"x ".as_slice(), want.as_bytes()].concat(),
                "{n} bytes"
            );
        }
    }

    #[test]
    fn per_cpu_sums_are_exact() {
        let u64s = vec![u64::MAX.to_le_bytes().to_vec(); 4];
        let sum = |v: &[Vec<u8>]| sum(PerCpuValues::from_slices(v));
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
        p.entry(&mut out, &t, single.view()).unwrap();
        p.entry(&mut out, &t, per_cpu.view()).unwrap();
        let mut sum = Printer::new(Format::Json, PerCpu::Sum, 0);
        sum.entry(&mut out, &t, per_cpu.view()).unwrap();
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
            .entry(&mut out, &t, per_cpu.view())
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "10.0.0.7:50051 0102 0100,0200\n"
        );

        let mut out = Vec::new();
        let mut table = Printer::new(Format::Table, PerCpu::Sum, t.as_str().len());
        table.entry(&mut out, &t, per_cpu.view()).unwrap();
        table.entry(&mut out, &t, single.view()).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "TARGET          KEY   VALUE\n10.0.0.7:50051  0102  3\n10.0.0.7:50051  0102  ff\n"
        );
    }
}
