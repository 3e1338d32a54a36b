//! Stacks as a pprof profile (`profile.proto`, gzipped): what `go tool
//! pprof`, Grafana Pyroscope and speedscope read. The messages are those
//! of github.com/google/pprof's proto/profile.proto (the fields used here,
//! with their numbers).

use std::{collections::HashMap, io::Write as _};

use crate::pb;

/// perftools.profiles.Profile.
#[derive(Clone, PartialEq, prost::Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(int64, tag = "14")]
    default_sample_type: i64,
}

/// perftools.profiles.ValueType.
#[derive(Clone, PartialEq, prost::Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

/// perftools.profiles.Sample: its locations leaf first.
#[derive(Clone, PartialEq, prost::Message)]
struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
}

/// perftools.profiles.Mapping (a module).
#[derive(Clone, PartialEq, prost::Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    /// The binary's ELF build ID (a string index), for profilers that
    /// symbolize by build ID.
    #[prost(int64, tag = "6")]
    build_id: i64,
    #[prost(bool, tag = "7")]
    has_functions: bool,
}

/// perftools.profiles.Location.
#[derive(Clone, PartialEq, prost::Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

/// perftools.profiles.Line.
#[derive(Clone, PartialEq, prost::Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
}

/// perftools.profiles.Function.
#[derive(Clone, PartialEq, prost::Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// What the values of a profile are: "off-cpu" in "microseconds",
/// "samples" in "count".
#[derive(Debug, Clone, Copy)]
pub struct SampleType<'a> {
    /// What is counted ("off-cpu", "samples").
    pub name: &'a str,
    /// In what ("microseconds", "count").
    pub unit: &'a str,
}

/// Builds a profile: strings, functions, locations and mappings each once.
#[derive(Default)]
struct Builder {
    profile: Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(String, String), u64>,
    locations: HashMap<(String, String, u64), u64>,
    mappings: HashMap<String, u64>,
}

impl Builder {
    fn string(&mut self, s: &str) -> i64 {
        if let Some(i) = self.strings.get(s) {
            return *i;
        }
        let i = self.profile.string_table.len() as i64;
        self.profile.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), i);
        i
    }

    fn mapping(&mut self, module: &str) -> u64 {
        if module.is_empty() {
            return 0;
        }
        if let Some(id) = self.mappings.get(module) {
            return *id;
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let filename = self.string(module);
        self.profile.mapping.push(Mapping {
            id,
            filename,
            build_id: 0,
            has_functions: true,
        });
        self.mappings.insert(module.to_owned(), id);
        id
    }

    /// The location of a frame named `name` in `module`: a named frame by
    /// its name (the same function at other addresses is one location), an
    /// unnamed one by its address.
    fn location(&mut self, name: &str, module: &str, address: u64) -> u64 {
        let key = (name.to_owned(), module.to_owned(), address);
        if let Some(id) = self.locations.get(&key) {
            return *id;
        }
        let function = match self.functions.get(&(name.to_owned(), module.to_owned())) {
            Some(id) => *id,
            None => {
                let id = self.profile.function.len() as u64 + 1;
                let (n, f) = (self.string(name), self.string(module));
                self.profile.function.push(Function {
                    id,
                    name: n,
                    system_name: n,
                    filename: f,
                });
                self.functions
                    .insert((name.to_owned(), module.to_owned()), id);
                id
            }
        };
        let id = self.profile.location.len() as u64 + 1;
        let mapping_id = self.mapping(module);
        self.profile.location.push(Location {
            id,
            mapping_id,
            address,
            line: vec![Line {
                function_id: function,
            }],
        });
        self.locations.insert(key, id);
        id
    }

    fn frame(&mut self, f: &pb::Frame, kernel: bool) -> u64 {
        if !f.build_id.is_empty() && !f.module.is_empty() {
            let id = self.mapping(&f.module);
            let build_id = self.string(&f.build_id);
            if let Some(m) = self.profile.mapping.get_mut(id as usize - 1) {
                m.build_id = build_id;
            }
        }
        match f.function.is_empty() {
            true => {
                let name = bpfmap_proto::stacks::frame_label(f);
                self.location(&name, &f.module, f.address)
            }
            false => {
                let module = match (f.module.is_empty(), kernel) {
                    (true, true) => "[kernel]",
                    _ => &f.module,
                };
                self.location(&f.function, module, 0)
            }
        }
    }
}

/// `stacks` as a pprof profile, gzipped: each stack a sample of one value
/// (its weight, saturating at 2^63-1), its roots as the outermost frames.
pub fn profile(stacks: &[pb::Stack], sample: SampleType<'_>) -> std::io::Result<Vec<u8>> {
    let mut b = Builder::default();
    b.string("");
    let (t, u) = (b.string(sample.name), b.string(sample.unit));
    b.profile.sample_type = vec![ValueType { r#type: t, unit: u }];
    for s in stacks {
        let mut ids: Vec<u64> = Vec::new();
        for f in s.kernel.iter().rev() {
            ids.push(b.frame(f, true));
        }
        for f in s.user.iter().rev() {
            ids.push(b.frame(f, false));
        }
        for r in s.roots.iter().rev() {
            ids.push(b.location(r, "", 0));
        }
        let weight: i128 = s.value.parse().unwrap_or(0);
        b.profile.sample.push(Sample {
            location_id: ids,
            value: vec![i64::try_from(weight.max(0)).unwrap_or(i64::MAX)],
        });
    }
    b.profile.time_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
    let bytes = prost::Message::encode_to_vec(&b.profile);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&bytes)?;
    gz.finish()
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use prost::Message as _;

    use super::*;

    #[test]
    fn a_profile_holds_each_stack_leaf_first_with_its_weight() {
        let frame = |f: &str, m: &str| pb::Frame {
            address: 7,
            function: f.into(),
            offset: 1,
            module: m.into(),
            ..Default::default()
        };
        let stacks = vec![
            pb::Stack {
                roots: vec!["sleep".into()],
                user: vec![frame("main", "/bin/sleep")],
                kernel: vec![
                    frame("entry_SYSCALL_64", "[kernel]"),
                    frame("schedule", "[kernel]"),
                ],
                value: "30".into(),
                ..Default::default()
            },
            pb::Stack {
                kernel: vec![
                    frame("schedule", "[kernel]"),
                    pb::Frame {
                        address: 0xffff_1234,
                        ..Default::default()
                    },
                ],
                value: "99999999999999999999".into(),
                ..Default::default()
            },
        ];
        let gz = profile(
            &stacks,
            SampleType {
                name: "off-cpu",
                unit: "microseconds",
            },
        )
        .unwrap();
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(gz.as_slice())
            .read_to_end(&mut raw)
            .unwrap();
        let p = Profile::decode(raw.as_slice()).unwrap();
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(s(0), "");
        assert_eq!(
            (s(p.sample_type[0].r#type), s(p.sample_type[0].unit)),
            ("off-cpu", "microseconds")
        );
        let names = |sample: &Sample| -> Vec<&str> {
            sample
                .location_id
                .iter()
                .map(|id| {
                    let l = &p.location[*id as usize - 1];
                    s(p.function[l.line[0].function_id as usize - 1].name)
                })
                .collect()
        };
        assert_eq!(
            names(&p.sample[0]),
            ["schedule", "entry_SYSCALL_64", "main", "sleep"]
        );
        assert_eq!(p.sample[0].value, [30]);
        assert_eq!(names(&p.sample[1]), ["0xffff1234", "schedule"]);
        assert_eq!(p.sample[1].value, [i64::MAX]);
        // "schedule" is one function and one location for both samples.
        assert_eq!(p.sample[0].location_id[0], p.sample[1].location_id[1]);
        assert_eq!(
            p.function
                .iter()
                .filter(|f| s(f.name) == "schedule")
                .count(),
            1
        );
    }

    #[test]
    fn a_frame_without_a_name_gives_its_binary_mapping_its_build_id() {
        let stacks = vec![pb::Stack {
            user: vec![pb::Frame {
                module: "/usr/bin/gone".into(),
                build_id: "b7a8c61e46477d0aa1fd59694bf61cb81fd01f20".into(),
                file_offset: 0x1194,
                ..Default::default()
            }],
            value: "3".into(),
            ..Default::default()
        }];
        let gz = profile(
            &stacks,
            SampleType {
                name: "samples",
                unit: "count",
            },
        )
        .unwrap();
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(gz.as_slice())
            .read_to_end(&mut raw)
            .unwrap();
        let p = Profile::decode(raw.as_slice()).unwrap();
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(p.mapping.len(), 1);
        assert_eq!(
            (s(p.mapping[0].filename), s(p.mapping[0].build_id)),
            ("/usr/bin/gone", "b7a8c61e46477d0aa1fd59694bf61cb81fd01f20")
        );
        let l = &p.location[p.sample[0].location_id[0] as usize - 1];
        assert_eq!(
            s(p.function[l.line[0].function_id as usize - 1].name),
            "b7a8c61e46477d0aa1fd59694bf61cb81fd01f20+0x1194"
        );
    }
}
