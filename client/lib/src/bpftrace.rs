//! bpftrace's maps read as bpftrace prints them.
//!
//! bpftrace (0.17 and earlier) keeps its aggregations in per-CPU hash maps
//! without types, and only its own printing makes sense of them:
//!
//! - `count()` and `sum()` keep one 64-bit integer per CPU: summed (a sum
//!   is signed);
//! - `max()` keeps the largest value per CPU (a CPU that saw none holds 0):
//!   the largest over the CPUs;
//! - `min()` keeps `0xffffffff - value` per CPU, so that its program can
//!   use an unsigned comparison: the largest of those over the CPUs, undone
//!   (bpftrace prints 0 when every CPU holds 0, as after `zero()`; values
//!   of 2^32 and above are not kept faithfully by bpftrace itself);
//! - `avg()` and `stats()` append an 8-byte index to the key: index 0
//!   counts the values, index 1 adds them up; the average is the total
//!   divided by the count, truncated as C divides.
//!
//! Nothing in such a map says which of these wrote it, so the function is
//! named ([`Function`]). Each is one AggregateMap call computed by the
//! daemon: every key a group, the CPUs combined there (SUM, or the MAX of
//! each CPU's value), so that a fleet merges them exactly (sums added,
//! maxima taken: a min map's stored maxima are the minima undone).
//! Entries are ordered as bpftrace orders them: by their value, smallest
//! first (by the average for `avg()` and `stats()`), then by key bytes.

use std::{fmt, str::FromStr};

use bpfmap_proto::typed::{self, Layout};

use crate::{
    Aggregate, AggregateOptions, Client, Error, Fleet, FleetAggregateOptions, MapName, PerCpu,
    Target, TargetReport,
};

/// The bpftrace function that keeps a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Function {
    /// `count()`: one u64 per CPU, summed.
    Count,
    /// `sum(x)`: one s64 per CPU, summed.
    Sum,
    /// `min(x)`: `0xffffffff - x` per CPU.
    Min,
    /// `max(x)`: the largest x per CPU.
    Max,
    /// `avg(x)`: a count and a total under an index appended to the key.
    Avg,
    /// `stats(x)`: as `avg`, printed with its count and total.
    Stats,
}

impl Function {
    const ALL: [Self; 6] = [
        Self::Count,
        Self::Sum,
        Self::Min,
        Self::Max,
        Self::Avg,
        Self::Stats,
    ];

    /// The function's name as bpftrace spells it ("count").
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Sum => "sum",
            Self::Min => "min",
            Self::Max => "max",
            Self::Avg => "avg",
            Self::Stats => "stats",
        }
    }

    /// Whether the key ends with the 8-byte index of `avg()` and `stats()`.
    fn indexed(self) -> bool {
        matches!(self, Self::Avg | Self::Stats)
    }

    /// The value type declared for the call, and the aggregate computed
    /// per key.
    fn question(self) -> (&'static str, Aggregate, PerCpu) {
        match self {
            Self::Count => ("__u64", Aggregate::sum("value"), PerCpu::Each),
            Self::Sum | Self::Avg | Self::Stats => ("__s64", Aggregate::sum("value"), PerCpu::Each),
            Self::Min | Self::Max => ("__s64", Aggregate::max("value"), PerCpu::Each),
        }
    }
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Function {
    type Err = Error;

    /// "count", "sum", "min", "max", "avg" or "stats" (with or without
    /// "()").
    fn from_str(s: &str) -> Result<Self, Error> {
        let name = s.strip_suffix("()").unwrap_or(s);
        Self::ALL
            .into_iter()
            .find(|f| f.as_str() == name)
            .ok_or_else(|| {
                Error::Bpftrace(format!(
                    "unknown bpftrace function {s:?}: count, sum, min, max, avg or stats (hist() and lhist() maps are read as histograms)"
                ))
            })
    }
}

/// One key's value, as bpftrace computes it from the CPUs' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BpftraceValue {
    /// `count()`.
    Count(u64),
    /// `sum()`.
    Sum(i64),
    /// `min()`.
    Min(i64),
    /// `max()`.
    Max(i64),
    /// `avg()`: its count and total.
    Avg {
        /// How many values.
        count: u64,
        /// Their total.
        total: i64,
    },
    /// `stats()`: its count and total.
    Stats {
        /// How many values.
        count: u64,
        /// Their total.
        total: i64,
    },
}

impl BpftraceValue {
    /// The average of `avg()` and `stats()` (the total divided by the
    /// count, truncated; 0 without values); the value itself otherwise.
    pub fn value(&self) -> i128 {
        match *self {
            Self::Count(n) => n.into(),
            Self::Sum(n) | Self::Min(n) | Self::Max(n) => n.into(),
            Self::Avg { count, total } | Self::Stats { count, total } => {
                if count == 0 {
                    0
                } else {
                    i128::from(total) / i128::from(count)
                }
            }
        }
    }
}

/// As bpftrace prints it: the value, the average of `avg()`, or `count C,
/// average A, total T` for `stats()`.
impl fmt::Display for BpftraceValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Stats { count, total } => {
                write!(f, "count {count}, average {}, total {total}", self.value())
            }
            _ => write!(f, "{}", self.value()),
        }
    }
}

/// One key of a bpftrace map.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BpftraceEntry {
    /// The key as bpftrace prints it between brackets ("python3", "7",
    /// "1, bash" for a tuple); `None` for a map without keys (`@x =
    /// count()`).
    pub key: Option<String>,
    /// The key's bytes (without the index of `avg()` and `stats()`).
    pub key_bytes: Vec<u8>,
    /// Its value.
    pub value: BpftraceValue,
}

/// A bpftrace map's entries, ordered as bpftrace prints them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BpftraceMap {
    /// What keeps the map.
    pub function: Function,
    /// Smallest first, as bpftrace orders them.
    pub entries: Vec<BpftraceEntry>,
}

impl BpftraceMap {
    /// The map as bpftrace prints it, one line per key (`@name[key]:
    /// value`); `name` is the map's name in the script, or its kernel
    /// name (bpftrace 0.17 names `@x` `AT_x`).
    pub fn print(&self, name: &str, out: &mut impl fmt::Write) -> fmt::Result {
        let name = script_name(name);
        for e in &self.entries {
            match &e.key {
                Some(k) => writeln!(out, "{name}[{k}]: {}", e.value)?,
                None => writeln!(out, "{name}: {}", e.value)?,
            }
        }
        Ok(())
    }

    /// The map from the groups of its question: each key's bytes and the
    /// aggregate over its CPUs.
    fn from_groups<'a>(
        function: Function,
        key_type: Option<&Layout>,
        groups: impl IntoIterator<Item = (&'a [u8], Option<i128>)>,
    ) -> Result<Self, Error> {
        use std::collections::BTreeMap;
        // Per key (its index cut), the count and the total.
        let mut keys: BTreeMap<Vec<u8>, (Option<i128>, Option<i128>)> = BTreeMap::new();
        for (bytes, value) in groups {
            if !function.indexed() {
                keys.entry(bytes.to_vec()).or_default().0 = value;
                continue;
            }
            let Some(cut) = bytes.len().checked_sub(8) else {
                return Err(Error::Bpftrace(format!(
                    "a key of {} bytes: an {function}() map's keys end with an 8-byte index (0 the count, 1 the total)",
                    bytes.len()
                )));
            };
            let (key, index) = bytes.split_at(cut);
            let index = u64::from_le_bytes(index.try_into().expect("8 bytes"));
            let slot = keys.entry(key.to_vec()).or_default();
            match index {
                0 => slot.0 = value,
                1 => slot.1 = value,
                _ => {
                    return Err(Error::Bpftrace(format!(
                        "a key ending with index {index}: an {function}() map's keys end with 0 (the count) or 1 (the total); is this map kept by {function}()?"
                    )));
                }
            }
        }
        let keyless = keys.len() == 1
            && key_type.is_none()
            && keys
                .keys()
                .next()
                .is_some_and(|k| k.is_empty() || (k.len() == 8 && k.iter().all(|b| *b == 0)));
        let mut entries = keys
            .into_iter()
            .map(|(key_bytes, (first, second))| {
                let value = value_of(function, first, second);
                let key = (!keyless)
                    .then(|| show_key(&key_bytes, key_type))
                    .transpose()?;
                Ok(BpftraceEntry {
                    key,
                    key_bytes,
                    value,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        entries
            .sort_by(|a, b| (a.value.value(), &a.key_bytes).cmp(&(b.value.value(), &b.key_bytes)));
        Ok(Self { function, entries })
    }
}

/// The name bpftrace prints for a map: `@x` for the kernel name `AT_x`
/// (and for `x`, `@x` and `name:AT_x@OWNER`'s `AT_x@OWNER`).
pub fn script_name(name: &str) -> String {
    let name = name.strip_prefix('@').unwrap_or(name);
    let bare = name.split('@').next().unwrap_or(name);
    format!("@{}", bare.strip_prefix("AT_").unwrap_or(bare))
}

/// A key's value computed as bpftrace computes it.
fn value_of(function: Function, first: Option<i128>, second: Option<i128>) -> BpftraceValue {
    // Sums over CPUs of 64-bit values wrap as bpftrace's do.
    let s64 = |v: Option<i128>| v.unwrap_or(0) as i64;
    match function {
        Function::Count => BpftraceValue::Count(s64(first) as u64),
        Function::Sum => BpftraceValue::Sum(s64(first)),
        Function::Max => BpftraceValue::Max(s64(first)),
        Function::Min => {
            let stored = s64(first);
            BpftraceValue::Min(if stored == 0 {
                0
            } else {
                0xffff_ffff_i64.wrapping_sub(stored)
            })
        }
        Function::Avg => BpftraceValue::Avg {
            count: s64(first) as u64,
            total: s64(second),
        },
        Function::Stats => BpftraceValue::Stats {
            count: s64(first) as u64,
            total: s64(second),
        },
    }
}

/// A key as bpftrace prints it: through its declared type (strings bare,
/// the members of a tuple joined by ", "), else an integer when it is 1,
/// 2, 4 or 8 bytes (bpftrace keeps integer keys as 64-bit signed
/// integers), else its bytes in hex.
fn show_key(bytes: &[u8], key_type: Option<&Layout>) -> Result<String, Error> {
    let Some(layout) = key_type else {
        return Ok(match bytes.len() {
            8 => i64::from_le_bytes(bytes.try_into().expect("8 bytes")).to_string(),
            4 => i32::from_le_bytes(bytes.try_into().expect("4 bytes")).to_string(),
            2 => i16::from_le_bytes(bytes.try_into().expect("2 bytes")).to_string(),
            1 => (bytes[0] as i8).to_string(),
            _ => format!("0x{}", hex(bytes)),
        });
    };
    if layout.size() != bytes.len() {
        return Err(Error::Bpftrace(format!(
            "the key type {} is {} bytes; the map's keys are {} bytes{}",
            layout.name(),
            layout.size(),
            bytes.len(),
            if bytes.len() == layout.size() + 8 {
                " (with the index of avg() or stats(): name the function)"
            } else {
                ""
            }
        )));
    }
    let value = layout.to_value(bytes);
    Ok(if layout.is_record() {
        let fields = match &value.kind {
            Some(prost_types::value::Kind::StructValue(s)) => Some(&s.fields),
            _ => None,
        };
        layout
            .member_names()
            .iter()
            .map(|m| {
                fields
                    .and_then(|f| f.get(*m))
                    .map_or_else(String::new, plain)
            })
            .collect::<Vec<_>>()
            .join(", ")
    } else {
        plain(&value)
    })
}

/// A decoded value as bpftrace prints it: strings without quotes.
fn plain(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::StringValue(s)) => s.clone(),
        Some(Kind::NumberValue(n)) => format!("{n}"),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::ListValue(l)) => format!(
            "[{}]",
            l.values.iter().map(plain).collect::<Vec<_>>().join(", ")
        ),
        _ => typed::value_brief(v),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Options of a bpftrace read ([`Client::bpftrace`], [`Fleet::bpftrace`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BpftraceOptions {
    function: Function,
    key_type: Option<String>,
}

impl BpftraceOptions {
    /// A map kept by `function`.
    pub fn new(function: Function) -> Self {
        Self {
            function,
            key_type: None,
        }
    }

    /// The key's type in C, as the script's key is (`char[16]` for `comm`,
    /// `struct { __u64 pid; char comm[16]; }` for `@[pid, comm]`), without
    /// the index of `avg()` and `stats()`. Without it, keys of 1, 2, 4 and
    /// 8 bytes print as integers, others in hex.
    pub fn with_key_type(mut self, c_type: impl Into<String>) -> Self {
        self.key_type = Some(c_type.into()).filter(|t: &String| !t.is_empty());
        self
    }

    /// The key type, checked.
    fn key_layout(&self) -> Result<Option<Layout>, Error> {
        self.key_type
            .as_deref()
            .map(|t| {
                typed::parse_c_type(t, "key")
                    .and_then(|info| Layout::new(&info, "key"))
                    .map_err(|e| Error::Bpftrace(format!("key type {t:?}: {e}")))
            })
            .transpose()
    }

    /// The map with the value declared as the function keeps it (the
    /// key stays bytes: its type is applied here, after the index is cut),
    /// and the aggregate that reads it.
    fn question(&self, map: &MapName) -> (MapName, AggregateOptions) {
        let (value, aggregate, per_cpu) = self.function.question();
        let map = map.clone().without_types().with_types("", value);
        let options = AggregateOptions::default()
            .with_group_by(["key"])
            .with_aggregate(aggregate)
            .with_per_cpu(per_cpu)
            .with_batched_scan();
        (map, options)
    }
}

impl Client {
    /// Reads a map bpftrace keeps with `options`' function, as bpftrace
    /// prints it ([`BpftraceMap`]). Errors: the daemon's for the
    /// AggregateMap call (INVALID_ARGUMENT when the values are not 8 bytes,
    /// FAILED_PRECONDITION when the map has types of its own),
    /// [`Error::Bpftrace`] for keys that do not fit the function or the
    /// key type.
    pub async fn bpftrace(
        &self,
        map: &MapName,
        options: BpftraceOptions,
    ) -> Result<BpftraceMap, Error> {
        let layout = options.key_layout()?;
        let (map, question) = options.question(map);
        let answer = self.aggregate(&map, question).await?;
        BpftraceMap::from_groups(
            options.function,
            layout.as_ref(),
            answer
                .groups()
                .iter()
                .map(|g| (g.key_bytes(), g.values().first().copied().flatten())),
        )
    }
}

/// A bpftrace map merged over a fleet: each key's CPUs and hosts combined
/// as bpftrace combines CPUs (counts and sums added, the maxima of `max()`
/// and of `min()`'s stored values taken).
#[derive(Debug)]
#[non_exhaustive]
pub struct FleetBpftrace {
    /// The merged map; `None` when no target answered or the keys do not
    /// fit (the error is in `error`).
    pub map: Option<BpftraceMap>,
    /// Keys that did not fit the function or the key type.
    pub error: Option<Error>,
    /// Every target's report.
    pub reports: Vec<TargetReport>,
    /// The targets that failed: the answer is that of the others.
    pub missing: Vec<Target>,
}

impl Fleet {
    /// Reads a bpftrace map on every target and merges it exactly
    /// ([`FleetBpftrace`]); through the relay when the fleet has one.
    pub async fn bpftrace(&self, map: &MapName, options: BpftraceOptions) -> FleetBpftrace {
        let layout = match options.key_layout() {
            Ok(l) => l,
            Err(e) => {
                return FleetBpftrace {
                    map: None,
                    error: Some(e),
                    reports: Vec::new(),
                    missing: Vec::new(),
                };
            }
        };
        let (map, question) = options.question(map);
        let merged = self
            .aggregate(
                &map,
                FleetAggregateOptions::default().with_aggregate(question),
            )
            .await;
        let answered = merged.reports.iter().any(|r| r.is_ok());
        let built = answered.then(|| {
            BpftraceMap::from_groups(
                options.function,
                layout.as_ref(),
                merged.groups.iter().map(|g| {
                    (
                        g.group.key_bytes(),
                        g.group.values().first().copied().flatten(),
                    )
                }),
            )
        });
        let (map, error) = match built {
            Some(Ok(m)) => (Some(m), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        FleetBpftrace {
            map,
            error,
            reports: merged.reports,
            missing: merged.missing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(rows: &[(Vec<u8>, i128)]) -> Vec<(&[u8], Option<i128>)> {
        rows.iter().map(|(k, v)| (k.as_slice(), Some(*v))).collect()
    }

    fn key(n: i64) -> Vec<u8> {
        n.to_le_bytes().to_vec()
    }

    fn indexed(n: i64, i: u64) -> Vec<u8> {
        [n.to_le_bytes(), i.to_le_bytes()].concat()
    }

    fn printed(m: &BpftraceMap, name: &str) -> String {
        let mut s = String::new();
        m.print(name, &mut s).unwrap();
        s
    }

    #[test]
    fn min_is_undone_and_zero_stays_zero() {
        // bpftrace stores 0xffffffff - x; its print undoes the largest.
        let rows = vec![
            (key(7), 0x1_0000_0002),
            (key(9), 0xffff_fffd),
            (key(10), 0xffff_ffff),
            (key(3), 0),
        ];
        let m = BpftraceMap::from_groups(Function::Min, None, groups(&rows)).unwrap();
        assert_eq!(
            printed(&m, "AT_mn"),
            "@mn[7]: -3\n@mn[3]: 0\n@mn[10]: 0\n@mn[9]: 2\n"
        );
    }

    #[test]
    fn avg_and_stats_pair_their_index_and_divide_as_c_does() {
        let rows = vec![
            (indexed(8, 0), 2),
            (indexed(8, 1), -30),
            (indexed(1, 0), 112),
            (indexed(1, 1), -60),
            (indexed(9, 0), 3),
            (indexed(9, 1), 402),
        ];
        let m = BpftraceMap::from_groups(Function::Stats, None, groups(&rows)).unwrap();
        assert_eq!(
            printed(&m, "AT_st"),
            "@st[8]: count 2, average -15, total -30\n@st[1]: count 112, average 0, total -60\n@st[9]: count 3, average 134, total 402\n"
        );
        let m = BpftraceMap::from_groups(Function::Avg, None, groups(&rows)).unwrap();
        assert_eq!(printed(&m, "av"), "@av[8]: -15\n@av[1]: 0\n@av[9]: 134\n");
        // A map without keys: the key is the index alone.
        let rows = vec![
            (0u64.to_le_bytes().to_vec(), 51),
            (1u64.to_le_bytes().to_vec(), 510),
        ];
        let m = BpftraceMap::from_groups(Function::Avg, None, groups(&rows)).unwrap();
        assert_eq!(printed(&m, "AT_av"), "@av: 10\n");
    }

    #[test]
    fn keys_print_through_their_type_and_misfits_are_said() {
        let comm = |s: &str| {
            let mut b = s.as_bytes().to_vec();
            b.resize(16, 0);
            b
        };
        let layout = Layout::new(&typed::parse_c_type("char[16]", "key").unwrap(), "key").unwrap();
        let rows = vec![(comm("bash"), 48), (comm("python3"), 3)];
        let m = BpftraceMap::from_groups(Function::Count, Some(&layout), groups(&rows)).unwrap();
        assert_eq!(printed(&m, "AT_c"), "@c[python3]: 3\n@c[bash]: 48\n");
        let tuple = Layout::new(
            &typed::parse_c_type("struct { __u64 pid; char comm[16]; }", "key").unwrap(),
            "key",
        )
        .unwrap();
        let rows = vec![([key(42), comm("sh")].concat(), 5)];
        let m = BpftraceMap::from_groups(Function::Sum, Some(&tuple), groups(&rows)).unwrap();
        assert_eq!(printed(&m, "AT_x"), "@x[42, sh]: 5\n");
        // The key type of an avg() map without its index is what is asked;
        // a key type of another size is said.
        let rows = vec![(comm("bash"), 1)];
        let e = BpftraceMap::from_groups(Function::Count, Some(&tuple), groups(&rows)).unwrap_err();
        assert!(
            e.to_string()
                .contains("24 bytes; the map's keys are 16 bytes"),
            "{e}"
        );
        let rows = vec![(indexed(1, 5), 1)];
        let e = BpftraceMap::from_groups(Function::Avg, None, groups(&rows)).unwrap_err();
        assert!(e.to_string().contains("index 5"), "{e}");
        assert!("median".parse::<Function>().is_err());
        assert_eq!("stats()".parse::<Function>().unwrap(), Function::Stats);
    }
}
