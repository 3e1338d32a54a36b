//! How bpfmapctl prints: JSON Lines, a table, or plain hex, every line with
//! its target; and the progress display on stderr.

use std::io;

use bpfmap_client::{
    EntryRef, LookupResult, MapInfo, MapTypes, PerCpuValues, Target, TargetReport, ValueRef,
    typed::{JsonWriter, write_json_string},
};
use clap::ValueEnum;
use serde_json::{Value as Json, json};

use crate::table::{Table, safe};

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
    /// An Arrow IPC stream (`dump` only): one table, a `target` column
    /// then the map's members, for pyarrow, polars and DuckDB; to `-o
    /// FILE` or a stdout that is not a terminal.
    Arrow,
    /// Folded stacks (`stacks` only, its default): `root;frame;frame
    /// value` per stack, for flamegraph.pl, inferno and speedscope.
    Folded,
    /// A pprof profile, gzipped (`stacks` only; to `-o FILE` or a stdout
    /// that is not a terminal): for `go tool pprof` and Pyroscope.
    Pprof,
    /// An SVG flame graph (`stacks` only).
    Svg,
}

impl Format {
    /// Whether only `stacks` writes it.
    pub(crate) fn stacks_only(self) -> bool {
        matches!(self, Self::Folded | Self::Pprof | Self::Svg)
    }
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

/// A value as text (hex, or per-CPU values joined by commas or summed).
fn value_text(per_cpu: PerCpu, value: ValueRef<'_>) -> io::Result<String> {
    Ok(match value {
        ValueRef::Single(v) => hex(v),
        ValueRef::PerCpu(vs) if per_cpu == PerCpu::Sum => sum(vs)?,
        ValueRef::PerCpu(vs) => vs.iter().map(hex).collect::<Vec<_>>().join(","),
    })
}

/// JSON lines a chunk's writer gathers before handing them to the output.
const LINES_BYTES: usize = 1 << 20;

/// Writes results in one format.
#[derive(Debug)]
pub(crate) struct Printer {
    format: Format,
    per_cpu: PerCpu,
    /// The line being written.
    line: Vec<u8>,
    /// The table being written (table format).
    table: Option<Table>,
    /// The last target written, and `"target":"..",` for JSON lines.
    target: Option<(Target, Vec<u8>)>,
    /// `--per-cpu sum` met a map that is not per-CPU.
    sum_ignored: bool,
    /// The Arrow stream (`--format arrow`).
    arrow: Option<crate::arrow_out::ArrowOut>,
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

/// `--per-cpu sum` of a value that cannot be summed, as a command's error.
fn unsummable(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("--per-cpu sum: {e} (use --per-cpu list)"),
    )
}

impl Printer {
    /// The format it writes.
    pub(crate) fn format(&self) -> Format {
        self.format
    }

    /// A printer.
    pub(crate) fn new(format: Format, per_cpu: PerCpu) -> Self {
        Self {
            format,
            per_cpu,
            line: Vec::with_capacity(256),
            table: None,
            target: None,
            sum_ignored: false,
            arrow: None,
        }
    }

    /// Starts the Arrow stream of a dump of `map` (`--format arrow`).
    pub(crate) fn start_arrow(&mut self, map: &str) {
        if self.format == Format::Arrow {
            let per_cpu = match self.per_cpu {
                PerCpu::List => bpfmap_client::table::PerCpuColumns::List,
                PerCpu::Sum => bpfmap_client::table::PerCpuColumns::Sum,
            };
            self.arrow = Some(crate::arrow_out::ArrowOut::new(per_cpu, map));
        }
    }

    /// The Arrow stream, when one was started.
    pub(crate) fn arrow(&mut self) -> Option<&mut crate::arrow_out::ArrowOut> {
        self.arrow.as_mut()
    }

    /// Writes what a table still holds, and says on `err` what the output
    /// did not (a `--per-cpu sum` that did not apply).
    pub(crate) fn finish(
        &mut self,
        out: &mut dyn io::Write,
        err: &mut dyn io::Write,
    ) -> io::Result<()> {
        if let Some(t) = &mut self.table {
            t.finish(out)?;
        }
        if let Some(mut arrow) = self.arrow.take() {
            arrow.finish(out)?;
        }
        if std::mem::take(&mut self.sum_ignored) {
            writeln!(
                err,
                "--per-cpu sum: the map's values are not per-CPU; they are shown as they are"
            )?;
        }
        Ok(())
    }

    /// A table row: a table of `header`'s columns is started by the first
    /// (a row of other columns starts another).
    fn table_row(
        &mut self,
        out: &mut dyn io::Write,
        header: Vec<String>,
        row: &[String],
    ) -> io::Result<()> {
        if self.table.as_ref().is_none_or(|t| t.header() != header) {
            if let Some(mut done) = self.table.take() {
                done.finish(out)?;
            }
            self.table = Some(Table::new(header));
        }
        self.table.as_mut().expect("a table").row(out, row)
    }

    /// Notes a single value under `--per-cpu sum`.
    fn saw(&mut self, value: ValueRef<'_>) {
        if self.per_cpu == PerCpu::Sum && matches!(value, ValueRef::Single(_)) {
            self.sum_ignored = true;
        }
    }

    /// Starts a JSON line for `target`: `{"target":"...",`; the target's
    /// escaping is kept from one line to the next.
    fn start_json_line(&mut self, target: &Target) {
        let mut line = std::mem::take(&mut self.line);
        line.clear();
        line.extend_from_slice(self.json_prefix(target));
        self.line = line;
    }

    /// `{"target":"...",` for `target`, kept from one line to the next.
    fn json_prefix(&mut self, target: &Target) -> &[u8] {
        if self.target.as_ref().is_none_or(|(t, _)| t != target) {
            let mut prefix = b"{\"target\":".to_vec();
            write_json_string(&mut prefix, target.as_str());
            prefix.push(b',');
            self.target = Some((target.clone(), prefix));
        }
        self.target.as_ref().map_or(&[], |(_, p)| p)
    }

    /// Appends a decoded value's field to a JSON line: `,"value":` and
    /// the value (summed over the CPUs with `--per-cpu sum`), or
    /// `,"per_cpu_values":` and a list.
    fn typed_value(
        per_cpu: PerCpu,
        types: &MapTypes,
        value: ValueRef<'_>,
        out: &mut Vec<u8>,
    ) -> io::Result<()> {
        match value {
            ValueRef::Single(v) => {
                out.extend_from_slice(b",\"value\":");
                types.value().write_json(v, out);
            }
            ValueRef::PerCpu(_) if per_cpu == PerCpu::Sum => {
                out.extend_from_slice(b",\"value\":");
                types
                    .render_sum(value, &mut JsonWriter::new(out))
                    .map_err(unsummable)?;
            }
            ValueRef::PerCpu(_) => {
                out.extend_from_slice(b",\"per_cpu_values\":");
                types.render_value(value, &mut JsonWriter::new(out));
            }
        }
        Ok(())
    }

    /// A row of a typed table: the target, then the key's and the value's
    /// members (or KEY / VALUE for types that are not records).
    fn typed_row(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        types: &MapTypes,
        found: Option<bool>,
        entry: EntryRef<'_>,
    ) -> io::Result<()> {
        let mut row = vec![("TARGET".to_owned(), target.to_string())];
        row.extend(cells(types.key(), &types.decode_key(entry.key), "KEY"));
        if let Some(found) = found {
            row.push(("FOUND".into(), if found { "yes" } else { "no" }.into()));
        }
        match entry.value {
            _ if found == Some(false) => row.push(("VALUE".into(), String::new())),
            v @ ValueRef::PerCpu(_) if self.per_cpu == PerCpu::Sum => {
                let sum = types.sum_value(v).map_err(unsummable)?;
                row.extend(cells(types.value(), &sum, "VALUE"));
            }
            v @ ValueRef::PerCpu(_) => {
                row.push(("PER_CPU_VALUES".into(), cell(&types.decode_value(v))));
            }
            v => row.extend(cells(types.value(), &types.decode_value(v), "VALUE")),
        }
        let (header, cells): (Vec<String>, Vec<String>) = row.into_iter().unzip();
        self.table_row(out, header, &cells)
    }

    /// A chunk of dump entries decoded through `types`: as JSON lines
    /// written straight into one buffer, handed to `out` by the MiB (no
    /// copy of each line), or entry by entry in the other formats.
    pub(crate) fn typed_entries<'a>(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        entries: impl IntoIterator<Item = EntryRef<'a>>,
        types: &MapTypes,
    ) -> io::Result<()> {
        if matches!(self.format, Format::Hex | Format::Table) {
            for e in entries {
                self.typed_entry(out, target, e, Some(types))?;
            }
            return Ok(());
        }
        let mut lines = std::mem::take(&mut self.line);
        lines.clear();
        let mut result = Ok(());
        for e in entries {
            let start = lines.len();
            if let Err(error) = self.typed_json_line(&mut lines, target, e, types) {
                // The lines before it are written, not the one it broke.
                lines.truncate(start);
                result = Err(error);
                break;
            }
            if lines.len() >= LINES_BYTES {
                if let Err(error) = out.write_all(&lines) {
                    result = Err(error);
                    lines.clear();
                    break;
                }
                lines.clear();
            }
        }
        let written = out.write_all(&lines);
        lines.clear();
        self.line = lines;
        result.and(written)
    }

    /// One dump entry as a JSON line, appended to `lines`.
    fn typed_json_line(
        &mut self,
        lines: &mut Vec<u8>,
        target: &Target,
        e: EntryRef<'_>,
        types: &MapTypes,
    ) -> io::Result<()> {
        self.saw(e.value);
        lines.extend_from_slice(self.json_prefix(target));
        lines.extend_from_slice(b"\"key\":");
        types.key().write_json(e.key, lines);
        Self::typed_value(self.per_cpu, types, e.value, lines)?;
        lines.extend_from_slice(b"}\n");
        Ok(())
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
        self.saw(e.value);
        match self.format {
            Format::Table => self.typed_row(out, target, types, None, e),
            _ => {
                let mut line = std::mem::take(&mut self.line);
                line.clear();
                let made = self.typed_json_line(&mut line, target, e, types);
                let written = made.and_then(|()| out.write_all(&line));
                self.line = line;
                written
            }
        }
    }

    /// A lookup result, decoded through `types` when given:
    /// `{"target","key","found"}` and, when found, its value.
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
        if let Some(v) = value {
            self.saw(v);
        }
        match (self.format, value) {
            (Format::Table, Some(v)) => {
                let entry = EntryRef {
                    key: r.key(),
                    value: v,
                };
                self.typed_row(out, target, types, Some(true), entry)
            }
            (Format::Table, None) => {
                let entry = EntryRef {
                    key: r.key(),
                    value: ValueRef::Single(&[]),
                };
                self.typed_row(out, target, types, Some(false), entry)
            }
            _ => {
                self.start_json_line(target);
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(b"\"key\":");
                types.key().write_json(r.key(), &mut line);
                line.extend_from_slice(found_field(r.found()));
                if let Some(v) = value
                    && let Err(e) = Self::typed_value(self.per_cpu, types, v, &mut line)
                {
                    self.line = line;
                    return Err(e);
                }
                line.extend_from_slice(b"}\n");
                let written = out.write_all(&line);
                self.line = line;
                written
            }
        }
    }

    /// One dump entry, written straight into the line (no JSON value or
    /// string per entry).
    pub(crate) fn entry(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        e: EntryRef<'_>,
    ) -> io::Result<()> {
        self.saw(e.value);
        match self.format {
            Format::Json | Format::Arrow | Format::Folded | Format::Pprof | Format::Svg => {
                self.json_entry(target, e)?
            }
            Format::Hex => self.hex_entry(target, e)?,
            Format::Table => {
                let value = value_text(self.per_cpu, e.value)?;
                let header = ["TARGET", "KEY", "VALUE"].map(String::from).to_vec();
                return self.table_row(out, header, &[target.to_string(), hex(e.key), value]);
            }
        }
        out.write_all(&self.line)
    }

    /// `{"target":..,"key":"..","value":".."}` (or `"per_cpu_values"`)
    /// into the line.
    fn json_entry(&mut self, target: &Target, e: EntryRef<'_>) -> io::Result<()> {
        self.start_json_line(target);
        let line = &mut self.line;
        line.extend_from_slice(b"\"key\":\"");
        push_hex(line, e.key);
        line.push(b'"');
        push_value(line, self.per_cpu, e.value)?;
        line.extend_from_slice(b"}\n");
        Ok(())
    }

    /// `TARGET KEY VALUE` into the line.
    fn hex_entry(&mut self, target: &Target, e: EntryRef<'_>) -> io::Result<()> {
        let line = &mut self.line;
        line.clear();
        line.extend_from_slice(safe(target.as_str()).as_bytes());
        line.push(b' ');
        push_hex(line, e.key);
        line.push(b' ');
        line.extend_from_slice(value_text(self.per_cpu, e.value)?.as_bytes());
        line.push(b'\n');
        Ok(())
    }

    /// A lookup result of an untyped map.
    pub(crate) fn lookup(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        r: &LookupResult,
    ) -> io::Result<()> {
        if let Some(v) = r.value() {
            self.saw(v);
        }
        let key = hex(r.key());
        match self.format {
            Format::Json | Format::Arrow | Format::Folded | Format::Pprof | Format::Svg => {
                self.start_json_line(target);
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(b"\"key\":");
                write_json_string(&mut line, &key);
                line.extend_from_slice(found_field(r.found()));
                if let Some(v) = r.value() {
                    push_value(&mut line, self.per_cpu, v)?;
                }
                line.extend_from_slice(b"}\n");
                let written = out.write_all(&line);
                self.line = line;
                written
            }
            Format::Hex => {
                let value = r.value().map(|v| value_text(self.per_cpu, v)).transpose()?;
                let value = value.unwrap_or_else(|| "-".to_owned());
                writeln!(out, "{} {key} {value}", safe(target.as_str()))
            }
            Format::Table => {
                let value = r.value().map(|v| value_text(self.per_cpu, v)).transpose()?;
                let found = if r.found() { "yes" } else { "no" };
                let header = ["TARGET", "KEY", "FOUND", "VALUE"].map(String::from);
                let row = [
                    target.to_string(),
                    key,
                    found.into(),
                    value.unwrap_or_default(),
                ];
                self.table_row(out, header.to_vec(), &row)
            }
        }
    }

    /// Map descriptions (ListMaps).
    pub(crate) fn maps(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        maps: &[MapInfo],
    ) -> io::Result<()> {
        for m in maps {
            match self.format {
                Format::Json | Format::Arrow | Format::Folded | Format::Pprof | Format::Svg => {
                    out.write_all(&map_json(target, m))?
                }
                Format::Hex => writeln!(
                    out,
                    "{} {} {} {} {} {} {}",
                    safe(target.as_str()),
                    safe(&m.map_name().to_string()),
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

    /// One map described (GetMap): as a JSON line, or every field a row.
    pub(crate) fn map(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        m: &MapInfo,
    ) -> io::Result<()> {
        if self.format != Format::Table {
            return self.maps(out, target, std::slice::from_ref(m));
        }
        let header = ["TARGET", "FIELD", "VALUE"].map(String::from).to_vec();
        for (field, value) in map_fields(m) {
            let row = [target.to_string(), field.to_owned(), value];
            self.table_row(out, header.clone(), &row)?;
        }
        Ok(())
    }

    /// A map as a table row.
    fn map_row(&mut self, out: &mut dyn io::Write, target: &Target, m: &MapInfo) -> io::Result<()> {
        let header = [
            "TARGET", "MAP", "NAME", "TYPE", "ID", "KEY", "VALUE", "MAX", "OWNERS",
        ]
        .map(String::from)
        .to_vec();
        let row = [
            target.to_string(),
            m.map_name().to_string(),
            m.name().to_owned(),
            m.type_name().to_owned(),
            m.id().to_string(),
            m.key_size().to_string(),
            m.value_size().to_string(),
            m.max_entries().to_string(),
            owners_text(m),
        ];
        self.table_row(out, header, &row)
    }
}

/// One change a watch saw: its type, its entry as a dump shows it (the
/// decoding the daemon did when the map's types are not known here), and
/// what moved: each counter's delta (an exact decimal) and rate, in the
/// order of `counters` (the members' declaration order).
#[derive(Debug)]
pub(crate) struct Change<'a> {
    pub(crate) kind: &'a str,
    pub(crate) entry: EntryRef<'a>,
    /// The daemon's decoding of the entry, for a map without types here.
    pub(crate) decoded: (
        Option<&'a prost_types::Value>,
        Option<&'a prost_types::Value>,
    ),
    pub(crate) deltas: Vec<(&'a str, &'a str, f64)>,
    pub(crate) resets: &'a [String],
}

impl Printer {
    /// A watch's change: a JSON line
    /// `{"target","type","key","value"|"per_cpu_values","deltas","rates","resets"}`,
    /// or a table row.
    pub(crate) fn change(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        c: &Change<'_>,
        types: Option<&MapTypes>,
    ) -> io::Result<()> {
        let deltas: Vec<String> = c
            .deltas
            .iter()
            .map(|(path, d, _)| {
                let name = path.strip_prefix("value.").unwrap_or(path);
                let sign = if d.starts_with('-') { "" } else { "+" };
                format!("{name} {sign}{d}")
            })
            .collect();
        if self.format == Format::Table {
            let mut row = vec![("TARGET".to_owned(), target.to_string())];
            row.push(("TYPE".into(), c.kind.to_owned()));
            row.extend(self.entry_cells(c, types)?);
            row.push(("DELTAS".into(), deltas.join(" ")));
            let (header, cells): (Vec<String>, Vec<String>) = row.into_iter().unzip();
            return self.table_row(out, header, &cells);
        }
        self.start_json_line(target);
        let mut line = std::mem::take(&mut self.line);
        line.extend_from_slice(b"\"type\":");
        write_json_string(&mut line, c.kind);
        line.extend_from_slice(b",\"key\":");
        match (types, c.decoded.0) {
            (Some(t), _) => t.key().write_json(c.entry.key, &mut line),
            (None, Some(k)) => write_value(k, &mut line),
            (None, None) => write_json_string(&mut line, &hex(c.entry.key)),
        }
        match (types, c.decoded.1) {
            (Some(t), _) => {
                if let Err(e) = Self::typed_value(self.per_cpu, t, c.entry.value, &mut line) {
                    self.line = line;
                    return Err(e);
                }
            }
            (None, Some(v)) => {
                let field: &[u8] = match c.entry.value {
                    ValueRef::PerCpu(_) if self.per_cpu == PerCpu::List => b",\"per_cpu_values\":",
                    _ => b",\"value\":",
                };
                line.extend_from_slice(field);
                write_value(v, &mut line);
            }
            (None, None) => push_value(&mut line, self.per_cpu, c.entry.value)?,
        }
        if !c.deltas.is_empty() {
            let deltas = c.deltas.iter().map(|(p, d, _)| (*p, json!(d)));
            line.extend_from_slice(b",\"deltas\":");
            push_object(&mut line, deltas);
            let rates = c.deltas.iter().map(|(p, _, r)| (*p, json!(r)));
            line.extend_from_slice(b",\"rates\":");
            push_object(&mut line, rates);
        }
        if !c.resets.is_empty() {
            line.extend_from_slice(b",\"resets\":");
            line.extend_from_slice(json!(c.resets).to_string().as_bytes());
        }
        line.extend_from_slice(b"}\n");
        let written = out.write_all(&line);
        self.line = line;
        written
    }

    /// A change's key and value as table cells.
    fn entry_cells(
        &self,
        c: &Change<'_>,
        types: Option<&MapTypes>,
    ) -> io::Result<Vec<(String, String)>> {
        let mut row = Vec::new();
        let Some(t) = types else {
            let text =
                |v: Option<&prost_types::Value>, bytes: &[u8]| v.map_or_else(|| hex(bytes), cell);
            row.push(("KEY".into(), text(c.decoded.0, c.entry.key)));
            let raw = match c.entry.value {
                ValueRef::Single(v) => hex(v),
                v => value_text(self.per_cpu, v)?,
            };
            row.push(("VALUE".into(), c.decoded.1.map_or(raw, cell)));
            return Ok(row);
        };
        row.extend(cells(t.key(), &t.decode_key(c.entry.key), "KEY"));
        match c.entry.value {
            v @ ValueRef::PerCpu(_) if self.per_cpu == PerCpu::Sum => {
                let sum = t.sum_value(v).map_err(unsummable)?;
                row.extend(cells(t.value(), &sum, "VALUE"));
            }
            v @ ValueRef::PerCpu(_) => {
                row.push(("PER_CPU_VALUES".into(), cell(&t.decode_value(v))));
            }
            v => row.extend(cells(t.value(), &t.decode_value(v), "VALUE")),
        }
        Ok(row)
    }
}

/// A JSON object of `fields`, in their order, appended to `line`.
pub(crate) fn push_object<'a>(line: &mut Vec<u8>, fields: impl Iterator<Item = (&'a str, Json)>) {
    line.push(b'{');
    for (i, (name, value)) in fields.enumerate() {
        if i > 0 {
            line.push(b',');
        }
        write_json_string(line, name);
        line.push(b':');
        line.extend_from_slice(value.to_string().as_bytes());
    }
    line.push(b'}');
}

/// `,"found":true` or `,"found":false`.
fn found_field(found: bool) -> &'static [u8] {
    if found {
        b",\"found\":true"
    } else {
        b",\"found\":false"
    }
}

/// An untyped value's field: `,"value":"..hex.."` (summed: its exact
/// decimal sum), or `,"per_cpu_values":[..]`.
fn push_value(line: &mut Vec<u8>, per_cpu: PerCpu, value: ValueRef<'_>) -> io::Result<()> {
    match value {
        ValueRef::Single(v) => {
            line.extend_from_slice(b",\"value\":\"");
            push_hex(line, v);
            line.push(b'"');
        }
        ValueRef::PerCpu(vs) if per_cpu == PerCpu::Sum => {
            line.extend_from_slice(b",\"value\":\"");
            line.extend_from_slice(sum(vs)?.as_bytes());
            line.push(b'"');
        }
        ValueRef::PerCpu(vs) => {
            line.extend_from_slice(b",\"per_cpu_values\":[");
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
    Ok(())
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

/// A map's types as text: "key ..., value ...", why they are unavailable,
/// or nothing.
fn types_text(m: &MapInfo) -> Option<String> {
    match m.types() {
        Ok(Some(t)) => Some(t.to_string()),
        Ok(None) => m
            .types_unavailable()
            .map(|why| format!("unavailable: {why}")),
        Err(e) => Some(format!("unusable: {e}")),
    }
}

/// Every field of a map's description as `show` tables it, in the JSON
/// line's order.
fn map_fields(m: &MapInfo) -> Vec<(&'static str, String)> {
    let p = m.as_proto();
    let list = |items: Vec<String>| match items.is_empty() {
        true => "-".to_owned(),
        false => items.join(", "),
    };
    vec![
        ("path", p.path.clone()),
        ("id", m.id().to_string()),
        ("name", m.name().to_owned()),
        ("type", m.type_name().to_owned()),
        ("key_size", m.key_size().to_string()),
        ("value_size", m.value_size().to_string()),
        ("max_entries", m.max_entries().to_string()),
        ("flags", format!("{:#x}", m.flags())),
        ("per_cpu", m.per_cpu().to_string()),
        ("possible_cpus", m.possible_cpus().to_string()),
        ("dump_method", m.dump_method().as_str().to_owned()),
        ("types", types_text(m).unwrap_or_else(|| "-".into())),
        (
            "render",
            list(p.render.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        ),
        ("pins", list(m.pins().to_vec())),
        (
            "programs",
            list(
                m.programs()
                    .iter()
                    .map(|p| format!("{} (id {}, {})", p.name, p.id, p.r#type))
                    .collect(),
            ),
        ),
        (
            "owners",
            list(
                m.owners()
                    .iter()
                    .map(|o| format!("{}[{}]", o.comm, o.pid))
                    .collect(),
            ),
        ),
        (
            "memlock",
            m.memlock().map_or_else(|| "-".into(), |b| b.to_string()),
        ),
        (
            "btf",
            format!(
                "id {}, key type {}, value type {}",
                p.btf_id, p.btf_key_type_id, p.btf_value_type_id
            ),
        ),
        (
            "holders_incomplete",
            m.holders_incomplete().unwrap_or("-").to_owned(),
        ),
        (
            "bpftrace",
            p.bpftrace.as_ref().map_or_else(
                || "-".into(),
                |b| {
                    let f = match (b.function.as_str(), b.step) {
                        ("", _) => "values".to_owned(),
                        ("lhist", 1..) => format!("lhist(_, {}, {}, {})", b.min, b.max, b.step),
                        (f, _) => format!("{f}()"),
                    };
                    match (b.key.as_str(), b.key_type.as_str()) {
                        ("", _) => format!("{f}, script {}", b.script),
                        (k, "") => format!("{f} keyed by [{k}], script {}", b.script),
                        (k, t) => format!("{f} keyed by [{k}] ({t}), script {}", b.script),
                    }
                },
            ),
        ),
    ]
}

/// A map as a JSON line: everything GetMap says about it, `target` first.
fn map_json(target: &Target, m: &MapInfo) -> Vec<u8> {
    let types = match types_text(m) {
        Some(t) => json!(t),
        None => Json::Null,
    };
    let p = m.as_proto();
    let fields: [(&str, Json); 23] = [
        ("target", json!(target.as_str())),
        ("path", json!(p.path)),
        ("id", json!(m.id())),
        ("name", json!(m.name())),
        ("type", json!(m.type_name())),
        ("key_size", json!(m.key_size())),
        ("value_size", json!(m.value_size())),
        ("max_entries", json!(m.max_entries())),
        ("flags", json!(m.flags())),
        ("per_cpu", json!(m.per_cpu())),
        ("possible_cpus", json!(m.possible_cpus())),
        ("btf_id", json!(p.btf_id)),
        ("btf_key_type_id", json!(p.btf_key_type_id)),
        ("btf_value_type_id", json!(p.btf_value_type_id)),
        ("dump_method", json!(m.dump_method().as_str())),
        ("types", types),
        (
            "render",
            json!(
                p.render
                    .iter()
                    .collect::<std::collections::BTreeMap<_, _>>()
            ),
        ),
        ("pins", json!(m.pins())),
        (
            "programs",
            Json::Array(
                m.programs()
                    .iter()
                    .map(|p| json!({"id": p.id, "name": p.name, "type": p.r#type}))
                    .collect(),
            ),
        ),
        (
            "owners",
            Json::Array(
                m.owners()
                    .iter()
                    .map(|o| json!({"pid": o.pid, "comm": o.comm}))
                    .collect(),
            ),
        ),
        ("memlock", json!(m.memlock())),
        ("holders_incomplete", json!(m.holders_incomplete())),
        (
            "bpftrace",
            p.bpftrace.as_ref().map_or(Json::Null, |b| {
                json!({
                    "function": b.function,
                    "key": b.key,
                    "key_type": b.key_type,
                    "min": b.min,
                    "max": b.max,
                    "step": b.step,
                    "script": b.script,
                })
            }),
        ),
    ];
    ordered_line(&fields)
}

/// A JSON object line with its fields in the order given.
pub(crate) fn ordered_line(fields: &[(&str, Json)]) -> Vec<u8> {
    let mut line = vec![b'{'];
    for (i, (name, value)) in fields.iter().enumerate() {
        if i > 0 {
            line.push(b',');
        }
        write_json_string(&mut line, name);
        line.push(b':');
        line.extend_from_slice(value.to_string().as_bytes());
    }
    line.extend_from_slice(b"}\n");
    line
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
        let mut p = Printer::new(Format::Json, PerCpu::List);
        p.entry(&mut out, &t, single.view()).unwrap();
        p.entry(&mut out, &t, per_cpu.view()).unwrap();
        let mut sum = Printer::new(Format::Json, PerCpu::Sum);
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
        // A sum is the value, as one exact decimal.
        assert_eq!(
            lines[2],
            json!({"target": "10.0.0.7:50051", "key": "0102", "value": "3"})
        );

        let mut out = Vec::new();
        Printer::new(Format::Hex, PerCpu::List)
            .entry(&mut out, &t, per_cpu.view())
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "10.0.0.7:50051 0102 0100,0200\n"
        );

        let mut out = Vec::new();
        let mut table = Printer::new(Format::Table, PerCpu::Sum);
        table.entry(&mut out, &t, per_cpu.view()).unwrap();
        table.entry(&mut out, &t, single.view()).unwrap();
        let mut err = Vec::new();
        table.finish(&mut out, &mut err).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "TARGET          KEY   VALUE\n10.0.0.7:50051  0102  3\n10.0.0.7:50051  0102  ff\n"
        );
        // The single value was not summed, and the user is told.
        assert_eq!(
            String::from_utf8(err).unwrap(),
            "--per-cpu sum: the map's values are not per-CPU; they are shown as they are\n"
        );
    }
}
