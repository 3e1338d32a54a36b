//! The filter language, operator by operator and type by type, on types
//! built by hand: what matches, and what is refused with which message.

use bpfmap_proto::v1::TypeInfo;

use super::*;
use crate::query::testing::{self as t, at};
use bpfmap_proto::typed::MapShape;

/// A map of `struct flow_key` to `struct everything`.
struct Map {
    key: TypeInfo,
    value: TypeInfo,
    cpus: Option<usize>,
}

impl Map {
    fn everything() -> Self {
        Self {
            key: t::flow_key(),
            value: t::everything(),
            cpus: None,
        }
    }

    fn flows() -> Self {
        Self {
            key: t::flow_key(),
            value: t::flow_stats(),
            cpus: None,
        }
    }

    fn compile(&self, source: &str) -> Result<Filter, FilterError> {
        let shape = t::layout(&self.key, &self.value, self.cpus);
        Filter::compile(source, &shape)
    }

    /// Whether `source` matches the entry (`stride` for per-CPU values).
    fn eval(&self, source: &str, key: &[u8], value: &[u8], stride: usize) -> bool {
        let f = self
            .compile(source)
            .unwrap_or_else(|e| panic!("{source:?} does not compile: {e}"));
        f.matches(&EntryRef { key, value, stride })
    }

    /// The error `source` compiles to.
    fn refused(&self, source: &str) -> String {
        match self.compile(source) {
            Ok(_) => panic!("{source:?} compiled"),
            Err(e) => e.to_string(),
        }
    }
}

/// The entry every `struct everything` case reads.
fn sample() -> Vec<u8> {
    let mut v = vec![0u8; at::SIZE];
    t::put(&mut v, at::U8, &[200]);
    t::put(&mut v, at::S8, &(-5i8).to_le_bytes());
    t::put(&mut v, at::U16, &u16::MAX.to_le_bytes());
    t::put(&mut v, at::S16, &(-30_000i16).to_le_bytes());
    t::put(&mut v, at::U32, &4_000_000_000u32.to_le_bytes());
    t::put(&mut v, at::S32, &(-2_000_000_000i32).to_le_bytes());
    t::put(&mut v, at::U64, &u64::MAX.to_le_bytes());
    t::put(&mut v, at::S64, &i64::MIN.to_le_bytes());
    t::put(&mut v, at::PORT, &443u16.to_be_bytes());
    t::put(&mut v, at::ADDR, &0x0A00_0001u32.to_be_bytes());
    // flags = 0b101, level = -3 (0b11101).
    t::put(&mut v, at::BITS, &[0b101 | (0b11101 << 3)]);
    t::put(&mut v, at::PROTO, &[17]);
    t::put(&mut v, at::OK, &[1]);
    t::put(&mut v, at::COMM, b"nginx-worker\0\0\0\0");
    t::put(&mut v, at::INNER, &7u32.to_le_bytes());
    t::put(&mut v, at::INNER + 4, &(-8i32).to_le_bytes());
    for i in 0..4u32 {
        t::put(
            &mut v,
            at::COUNTERS + 4 * i as usize,
            &(i + 1).to_le_bytes(),
        );
    }
    t::put(&mut v, at::ANON, &0x0005_0006u32.to_le_bytes());
    t::put(&mut v, at::U128, &(1u128 << 100).to_le_bytes());
    v
}

/// Each `(filter, matches)` against the sample entry.
fn check(map: &Map, cases: &[(&str, bool)]) {
    let key = t::flow(0x0A00_0001, 0xC0A8_0001, 1024, 443, 6);
    let value = sample();
    for (source, want) in cases {
        let got = map.eval(source, &key, &value, 0);
        assert_eq!(got, *want, "{source:?} on the sample entry");
    }
}

#[test]
fn integers_of_every_width_compare_exactly() {
    check(
        &Map::everything(),
        &[
            ("value.u8 == 200", true),
            ("value.u8 > 199 && value.u8 < 201", true),
            ("value.s8 == -5", true),
            ("value.s8 < 0", true),
            ("value.u16 == 65535", true),
            ("value.s16 == -30000", true),
            ("value.u32 == 4000000000", true),
            ("value.s32 == -2000000000", true),
            ("value.u64 == 18446744073709551615u", true),
            ("value.u64 > 18446744073709551614u", true),
            ("value.u64 >= 18446744073709551615u", true),
            ("value.u64 != 18446744073709551615u", false),
            // Exact across signedness: u64 max is not -1.
            ("value.u64 == -1", false),
            ("value.u64 > 9223372036854775807", true),
            ("value.s64 == -9223372036854775808", true),
            ("value.s64 < -9223372036854775807", true),
            ("value.s64 < value.u64", true),
            ("value.u128 == 1125899906842624 * 1125899906842624", true),
            ("value.u128 > 18446744073709551615u", true),
            (
                "value.u8 <= 200 && value.u8 >= 200 && value.u8 != 201",
                true,
            ),
        ],
    );
}

#[test]
fn an_unsigned_128_bit_member_above_the_signed_range_is_an_error_not_negative() {
    let map = Map::everything();
    let key = t::flow(1, 2, 3, 4, 6);
    let mut value = sample();
    t::put(&mut value, at::U128, &u128::MAX.to_le_bytes());
    assert!(!map.eval("value.u128 < 0", &key, &value, 0));
    assert!(!map.eval("value.u128 > 0", &key, &value, 0));
    assert!(map.eval("!(value.u128 > 0 && false)", &key, &value, 0));
}

#[test]
fn big_endian_members_and_bitfields_read_by_value() {
    check(
        &Map::everything(),
        &[
            ("value.port == 443", true),
            ("value.port == 47873", false),
            ("value.addr == 167772161", true),
            ("value.flags == 5", true),
            ("value.level == -3", true),
            ("value.level < 0 && value.flags > 4", true),
        ],
    );
}

#[test]
fn enums_compare_by_name_and_number_and_in_lists() {
    check(
        &Map::everything(),
        &[
            ("value.proto == \"IPPROTO_UDP\"", true),
            ("\"IPPROTO_UDP\" == value.proto", true),
            ("value.proto != \"IPPROTO_TCP\"", true),
            ("value.proto == 17", true),
            ("value.proto in [\"IPPROTO_TCP\", \"IPPROTO_UDP\"]", true),
            ("value.proto in [\"IPPROTO_TCP\", 1]", false),
            ("key.proto == \"IPPROTO_TCP\"", true),
            ("key.proto in [6]", true),
        ],
    );
    let e = Map::everything().refused("key.proto == \"IPPROTO_SCTP\"");
    assert_eq!(
        e,
        "filter: key.proto == \"IPPROTO_SCTP\" (column 1): \"IPPROTO_SCTP\" is not an enumerator of the member's enum (IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP)"
    );
    let e = Map::everything().refused("key.proto in [\"IPPROTO_TCP\", \"TCP\"]");
    assert_eq!(
        e,
        "filter: \"TCP\" (column 30): \"TCP\" is not an enumerator of the member's enum (IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP)"
    );
}

#[test]
fn bools_are_conditions_compared_with_equality_only() {
    let map = Map::everything();
    check(
        &map,
        &[
            ("value.ok", true),
            ("value.ok == true", true),
            ("value.ok != false", true),
            ("!value.ok", false),
            ("value.ok && true", true),
        ],
    );
    assert_eq!(
        map.refused("value.ok < true"),
        "filter: value.ok < true (column 1): bools are compared with == and != only"
    );
}

#[test]
fn char_arrays_are_strings_up_to_their_first_nul() {
    check(
        &Map::everything(),
        &[
            ("value.comm == \"nginx-worker\"", true),
            ("value.comm.startsWith(\"nginx\")", true),
            ("value.comm.startsWith(\"worker\")", false),
            ("value.comm.endsWith(\"worker\")", true),
            ("value.comm.endsWith(\"\\x00\")", false),
            ("value.comm.contains(\"x-w\")", true),
            ("value.comm.contains(\"\")", true),
            ("value.comm.contains(\"apache\")", false),
            ("value.comm.matches(\"^ng.*r$\")", true),
            ("value.comm.matches(\"^worker\")", false),
            ("value.comm.size() == 12", true),
            ("size(value.comm) == 12", true),
            ("value.comm in [\"curl\", \"nginx-worker\"]", true),
            ("value.comm in [\"nginx\"]", false),
            ("value.comm > \"nginx\"", true),
            ("value.comm < \"nginx\"", false),
        ],
    );
}

#[test]
fn nested_structs_arrays_and_anonymous_members() {
    check(
        &Map::everything(),
        &[
            ("value.inner.x == 7", true),
            ("value.inner.y == -8", true),
            ("value.counters[0] == 1 && value.counters[3] == 4", true),
            ("value.counters[2] == 3u", true),
            ("value.anon_a == 327686", true),
            ("value.anon_b == 6", true),
            ("key.dport == 443 && key.sport == 1024", true),
            ("key.saddr == 167772161 && key.daddr == 3232235521", true),
        ],
    );
}

#[test]
fn in_lists_of_integers_and_strings_long_and_short() {
    // As long as the length limit allows: 800 elements, a hash set.
    let long: Vec<String> = (1000..1800).map(|i| i.to_string()).collect();
    let with = format!("key.sport in [{}]", long.join(","));
    let without = format!("key.dport in [{}]", long.join(","));
    let map = Map::everything();
    check(
        &map,
        &[
            ("key.dport in [80, 443]", true),
            ("key.dport in [80, 8080]", false),
            ("key.dport in []", false),
            (&with, true),
            (&without, false),
            ("value.s8 in [-5, 5]", true),
        ],
    );
    assert_eq!(
        map.refused("key.dport in [80, \"http\"]"),
        "filter: \"http\" (column 19): the list holds something else: integer literals only"
    );
    assert_eq!(
        map.refused("value.comm in [\"a\", 1]"),
        "filter: 1 (column 21): the list holds string or bytes literals only"
    );
    assert_eq!(
        map.refused("key.dport in key.sport"),
        "filter: key.sport (column 14): `in` takes a list literal: x in [1, 2, 3]"
    );
    assert_eq!(
        map.refused("value.ok in [true]"),
        "filter: value.ok in [true] (column 1): `in` is for integers and strings, not bool"
    );
}

#[test]
fn arithmetic_is_exact_and_overflow_or_division_by_zero_is_an_error() {
    check(
        &Map::everything(),
        &[
            ("value.u32 + value.u32 == 8000000000", true),
            ("value.inner.x * 3 - 1 == 20", true),
            ("value.inner.x / 2 == 3", true),
            ("value.inner.x % 4 == 3", true),
            ("-value.inner.y == 8", true),
            ("value.u64 + 1 == 18446744073709551615u + 1", true),
            ("value.u64 + 1 > value.u64", true),
            ("value.s64 - 1 < value.s64", true),
            // 2^192: past 128 bits.
            ("value.u64 * value.u64 * value.u64 > 0", false),
            ("value.u64 * value.u64 * value.u64 <= 0", false),
            ("value.inner.x / (value.inner.x - 7) == 1", false),
            ("value.inner.x % 0 == 1", false),
            ("!(value.inner.x / 0 == 1)", false),
        ],
    );
    let map = Map::everything();
    assert_eq!(
        map.refused("value.comm + 1 == 2"),
        "filter: value.comm + 1 (column 1): arithmetic is on integers: string and int"
    );
    assert_eq!(
        map.refused("-value.ok"),
        "filter: -value.ok (column 1): `-` needs an integer, not bool"
    );
}

#[test]
fn errors_follow_cel_logic_absorbed_by_the_other_side() {
    // `value.inner.x / 0 == 1` is an error on every entry.
    let err = "value.inner.x / 0 == 1";
    let cases: Vec<(String, bool)> = vec![
        (format!("{err} || true"), true),
        (format!("true || {err}"), true),
        (format!("{err} || false"), false),
        (format!("!({err} && false)"), true),
        (format!("!(false && {err})"), true),
        (format!("!({err} && true)"), false),
        (format!("!({err} || false)"), false),
        (format!("{err} ? true : true"), false),
        (format!("true ? true : {err}"), true),
        (format!("false ? {err} : true"), true),
        (format!("!({err})"), false),
        (format!("({err}) == false"), false),
    ];
    let cases: Vec<(&str, bool)> = cases.iter().map(|(s, b)| (s.as_str(), *b)).collect();
    check(&Map::everything(), &cases);
}

#[test]
fn conditionals_choose_a_branch_of_one_type() {
    let map = Map::everything();
    check(
        &map,
        &[
            ("value.inner.x > 5 ? value.port == 443 : false", true),
            ("value.inner.x > 9 ? true : value.comm == \"x\"", false),
            ("(key.dport == 443 ? value.u8 : value.u16) == 200", true),
            ("(key.dport == 80 ? value.u8 : value.u16) == 65535", true),
        ],
    );
    assert_eq!(
        map.refused("key.dport == 443 ? 1 : \"x\""),
        "filter: key.dport == 443 ? 1 : \"x\" (column 1): the branches of `? :` are int and string"
    );
    assert_eq!(
        map.refused("key.dport ? true : false"),
        "filter: key.dport (column 1): is __u16: the condition of `? :` is a bool"
    );
}

#[test]
fn logic_operators_need_bools() {
    let map = Map::everything();
    assert_eq!(
        map.refused("key.dport && true"),
        "filter: key.dport (column 1): is __u16, not bool: `&&` and `||` join conditions"
    );
    assert_eq!(
        map.refused("!key.dport"),
        "filter: !key.dport (column 1): `!` needs a bool, not __u16"
    );
    assert_eq!(
        map.refused("key.dport"),
        "filter: the expression is __u16, not bool: a filter says whether an entry is sent"
    );
}

#[test]
fn members_that_do_not_fit_are_refused_naming_the_member_and_its_position() {
    let map = Map::flows();
    let cases = [
        (
            "key.dprt == 1",
            "key.dprt (column 1): key.dprt: no such member of struct flow_key (members: saddr, daddr, sport, dport, proto)",
        ),
        (
            "key.dport == 443 && key.dprt == 1",
            "key.dprt (column 21): key.dprt: no such member of struct flow_key (members: saddr, daddr, sport, dport, proto)",
        ),
        (
            "value.bytes > \"x\"",
            "value.bytes > \"x\" (column 1): cannot compare __u64 with string",
        ),
        (
            "value.bytes == b\"x\"",
            "value.bytes == b\"x\" (column 1): cannot compare __u64 with bytes",
        ),
        (
            "key.dport.x == 1",
            "key.dport.x (column 1): key.dport.x: key.dport is __u16, which has no members",
        ),
        (
            "key[0] == 1",
            "key[0] (column 1): key[0]: key is struct flow_key, not an array",
        ),
        (
            "values[0].bytes == 1",
            "values[0].bytes (column 1): values[0]: the map is not per-CPU (use value, not values[i])",
        ),
        (
            "flow.dport == 1",
            "flow.dport (column 1): not a member path (key.member, value.member[i], values[i].member)",
        ),
        (
            "dport == 1",
            "dport (column 1): unknown name \"dport\": a filter reads key, value (and values[i] for per-CPU maps)",
        ),
        (
            "key == 1",
            "key (column 1): key is struct flow_key, which a filter cannot compare (integers, enums, bools, char arrays and bytes can be)",
        ),
        (
            "key.dport.startsWith(\"4\")",
            "key.dport (column 1): is __u16: startsWith() is for strings (char arrays) and bytes",
        ),
        (
            "size(key.dport) == 2",
            "key.dport (column 6): is __u16: size() is for strings (char arrays) and bytes",
        ),
    ];
    for (source, want) in cases {
        assert_eq!(map.refused(source), format!("filter: {want}"), "{source:?}");
    }
}

#[test]
fn what_the_language_leaves_out_is_refused_saying_so() {
    let map = Map::everything();
    let cases = [
        (
            "[1, 2].exists(x, x == key.dport)",
            "comprehensions (all, exists, exists_one, map, filter) are not supported in filters",
        ),
        (
            "key.dport == 443 && [1].all(x, x > 0)",
            "comprehensions (all, exists, exists_one, map, filter) are not supported in filters",
        ),
        (
            "value.u64 > 1.5",
            "floating-point numbers are not supported in filters",
        ),
        ("value.u64 == null", "null is not supported in filters"),
        (
            "{1: 2}[1] == 2",
            "maps and messages are not supported in filters",
        ),
        ("[1, 2] == [1, 2]", "a list is only allowed after `in`"),
        (
            "timestamp(value.u64) > 0",
            "unknown function or operator \"timestamp\" in a filter",
        ),
        (
            "has(key.dport)",
            "has() is not needed: a map's members are always present",
        ),
        (
            "value.comm.startsWith(value.comm)",
            "startsWith() takes a literal",
        ),
        (
            "value.comm.matches(\"(\")",
            "not a regular expression (RE2 syntax)",
        ),
        ("value.comm.size(1) == 1", "size() takes no argument"),
        (
            "value.counters[4] == 0",
            "value.counters[4]: out of bounds (__u32[4] has 4 elements)",
        ),
        (
            "value.u8.u32(0) == 0",
            "u32 reads the bytes of key, value or values[i]",
        ),
    ];
    for (source, want) in cases {
        let e = map.refused(source);
        assert!(
            e.starts_with("filter: ") && e.contains(want),
            "{source:?}: {e}"
        );
        assert!(e.contains("(column "), "{source:?} names no position: {e}");
    }
}

#[test]
fn syntax_errors_quote_the_parser_with_line_and_column() {
    let map = Map::everything();
    let e = map.refused("key.dport == ");
    assert!(e.starts_with("filter: Syntax error"), "{e}");
    assert!(e.contains("(line 1, column 14)"), "{e}");
    let e = map.refused("key.dport === 1");
    assert!(e.contains("line 1, column"), "{e}");
    let e = map.refused("");
    assert!(e.starts_with("filter: "), "{e}");
}

#[test]
fn limits_bound_length_nesting_nodes_lists_and_regexes() {
    let map = Map::everything();
    let long = format!("key.dport == 1{}", " ".repeat(MAX_FILTER_LEN));
    assert_eq!(
        map.refused(&long),
        format!(
            "filter: {} bytes: a filter is at most {MAX_FILTER_LEN}",
            long.len()
        )
    );
    let deep = format!("{}key.dport == 1{}", "(".repeat(40), ")".repeat(40));
    assert_eq!(
        map.refused(&deep),
        "filter: nested too deeply: at most 32 levels"
    );
    let nots = format!("{}value.ok", "!".repeat(600));
    assert_eq!(
        map.refused(&nots),
        "filter: nested too deeply: at most 32 levels"
    );
    let wide = vec!["1==1"; 200];
    assert_eq!(
        map.refused(&wide.join("||")),
        "filter: too large: at most 512 operators and operands"
    );
    let huge: Vec<String> = (0..MAX_LIST_ELEMENTS + 1).map(|i| i.to_string()).collect();
    let huge = format!("key.dport in [{}]", huge.join(","));
    assert!(huge.len() > MAX_FILTER_LEN);
    assert!(map.refused(&huge).contains("a filter is at most 4096"));
    let re = format!("value.comm.matches(\"{}\")", "a".repeat(300));
    assert!(
        map.refused(&re)
            .contains("a regular expression is at most 256 bytes"),
        "{re}"
    );
    let big = "value.comm.matches(\"(\\\\w{100}){100}\")";
    let e = map.refused(big);
    assert!(e.contains("not a regular expression (RE2 syntax)"), "{e}");
}

#[test]
fn a_pathological_regex_stays_linear() {
    let map = Map {
        key: t::flow_key(),
        value: TypeInfo {
            size: 4096,
            ..t::chars(4096)
        },
        cpus: None,
    };
    let f = map.compile("value.matches(\"(a*)*b\")").unwrap();
    let value = vec![b'a'; 4096];
    let key = t::flow(1, 2, 3, 4, 6);
    let started = std::time::Instant::now();
    for _ in 0..100 {
        assert!(!f.matches(&EntryRef {
            key: &key,
            value: &value,
            stride: 0
        }));
    }
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(2),
        "100 matches of (a*)*b on 4096 bytes took {took:?}"
    );
}

/// A per-CPU map of `struct flow_stats` on 4 CPUs.
fn per_cpu() -> (Map, Vec<u8>) {
    let map = Map {
        key: t::flow_key(),
        value: t::flow_stats(),
        cpus: Some(4),
    };
    let mut value = Vec::new();
    for cpu in 0..4u64 {
        value.extend_from_slice(&t::stats(cpu + 1, u64::MAX - cpu));
    }
    (map, value)
}

#[test]
fn per_cpu_values_are_summed_exactly_and_read_one_cpu_at_a_time() {
    let (map, value) = per_cpu();
    let key = t::flow(1, 2, 3, 4, 6);
    let cases = [
        ("value.packets == 10".to_owned(), true),
        (
            "value.bytes == 18446744073709551615u * 4 - 6".to_owned(),
            true,
        ),
        ("value.bytes == 18446744073709551615u * 4".to_owned(), false),
        ("value.bytes > 18446744073709551615u".to_owned(), true),
        (
            "values[0].packets == 1 && values[3].packets == 4".to_owned(),
            true,
        ),
        ("values[1].bytes == 18446744073709551614u".to_owned(), true),
        ("values[2].packets > values[1].packets".to_owned(), true),
    ];
    for (source, want) in cases {
        assert_eq!(map.eval(&source, &key, &value, 16), want, "{source}");
    }
    assert_eq!(
        map.refused("values[4].packets == 1"),
        "filter: values[4].packets (column 1): values[4]: the host has 4 possible CPUs"
    );
}

#[test]
fn per_cpu_sums_refuse_what_cannot_be_summed() {
    let map = Map {
        key: t::flow_key(),
        value: t::everything(),
        cpus: Some(2),
    };
    let e = map.refused("value.comm == \"x\"");
    assert_eq!(
        e,
        "filter: value.comm (column 1): value.comm: per-CPU values are summed over the CPUs for `value`, and only integers can be (this is char[16]); read one CPU's with values[i]"
    );
    let e = map.refused("value.ok");
    assert!(
        e.contains("value.ok: per-CPU values are summed over the CPUs for `value`, and only integers can be (this is bool)"),
        "{e}"
    );
    let mut value = sample();
    value.extend_from_slice(&sample());
    let key = t::flow(1, 2, 3, 4, 6);
    assert!(map.eval(
        "values[1].comm.startsWith(\"nginx\")",
        &key,
        &value,
        at::SIZE
    ));
    assert!(map.eval("value.inner.x == 14", &key, &value, at::SIZE));
}

/// A map without types: 8-byte keys, 16-byte values.
fn untyped() -> (MapLayout, Vec<u8>, Vec<u8>) {
    let shape = MapLayout::untyped(MapShape::new(8, 16));
    let key = 0x0102_0304_0506_0708u64.to_le_bytes().to_vec();
    let mut value = vec![0u8; 16];
    value[4..6].copy_from_slice(&443u16.to_be_bytes());
    value[8..16].copy_from_slice(&(-2i64).to_le_bytes());
    (shape, key, value)
}

#[test]
fn untyped_maps_read_integers_at_byte_offsets() {
    let (shape, key, value) = untyped();
    let cases = [
        ("key.u32(0) == 0x05060708", true),
        ("key.u32(4) == 0x01020304", true),
        ("key.u64(0) == 0x0102030405060708", true),
        ("key.u8(7) == 1 && key.i8(0) == 8", true),
        ("key.u16(6) == 0x0102", true),
        ("key.be16(0) == 0x0807", true),
        ("key.be32(0) == 0x08070605", true),
        ("key.be64(0) == 0x0807060504030201", true),
        ("value.be16(4) == 443", true),
        ("value.u16(4) == 443", false),
        ("value.i64(8) == -2", true),
        ("value.u64(8) == 18446744073709551614u", true),
        ("value.i32(8) == -2 && value.i16(8) == -2", true),
        ("u32(key, 0) == 0x05060708", true),
        ("key == b\"\\x08\\x07\\x06\\x05\\x04\\x03\\x02\\x01\"", true),
        ("key.startsWith(b\"\\x08\\x07\")", true),
        ("key.size() == 8", true),
        (
            "key in [b\"\\x00\", b\"\\x08\\x07\\x06\\x05\\x04\\x03\\x02\\x01\"]",
            true,
        ),
    ];
    for (source, want) in cases {
        let f = Filter::compile(source, &shape).unwrap_or_else(|e| panic!("{source}: {e}"));
        let e = EntryRef {
            key: &key,
            value: &value,
            stride: 0,
        };
        assert_eq!(f.matches(&e), want, "{source}");
    }
}

#[test]
fn untyped_maps_refuse_members_and_reads_past_the_end() {
    let (shape, _, _) = untyped();
    let refused = |s: &str| Filter::compile(s, &shape).unwrap_err().to_string();
    assert_eq!(
        refused("key.dport == 1"),
        "filter: key.dport (column 1): key.dport: the map has no types (BTF): its key is bytes"
    );
    assert_eq!(
        refused("value.u64(12) == 1"),
        "filter: value.u64(12) (column 1): reads bytes 12..20 of a 16-byte value"
    );
    assert_eq!(
        refused("key.u32(-1) == 1"),
        "filter: -1 (column 9): the offset is a number of bytes"
    );
    assert_eq!(
        refused("key.u32() == 1"),
        "filter: key.u32() (column 1): u32(OFFSET) is called on key or value"
    );
    assert_eq!(
        refused("key == \"x\""),
        "filter: key == \"x\" (column 1): cannot compare bytes with string"
    );
}

#[test]
fn global_calls_are_quoted_from_their_name() {
    let map = Map::everything();
    assert_eq!(
        map.refused("key.dport == 1 && system(\"reboot\")"),
        "filter: system(\"reboot\") (column 19): unknown function or operator \"system\" in a filter"
    );
    assert_eq!(
        map.refused("key.dport == 1 &&\n  u32(value.comm, 0) == 1"),
        "filter: value.comm (line 2, column 7): u32 reads the bytes of key, value or values[i]"
    );
}

#[test]
fn a_filter_holds_at_most_eight_regular_expressions() {
    let map = Map::everything();
    let eight: Vec<String> = (0..8)
        .map(|i| format!("value.comm.matches(\"x{i}\")"))
        .collect();
    assert!(map.compile(&eight.join(" || ")).is_ok());
    let nine = format!("{} || value.comm.matches(\"y\")", eight.join(" || "));
    assert_eq!(
        map.refused(&nine),
        "filter: value.comm.matches(\"y\") (column 225): at most 8 regular expressions in a filter"
    );
}

#[test]
fn a_prefilter_for_the_kernel_leaves_out_what_it_cannot_test_and_says_what() {
    use bpfmap_kernel::program::Cond;

    use crate::query::scan::Untranslatable;
    let map = Map::everything();
    let sizes = crate::query::scan::Sizes {
        key: 64,
        value: 4096,
        cpus: None,
    };
    let pre = |source: &str| map.compile(source).unwrap().kernel_prefilter(sizes);
    // All of it: no reason.
    let (c, why) = pre("key.dport == 443 && value.u8 > 3");
    assert!(matches!(c, Cond::All(ref cs) if cs.len() == 2), "{c:?}");
    assert!(why.is_empty());
    // The text comparison is left to user space, the port kept.
    let (c, why) = pre(r#"key.dport == 443 && value.comm == "nginx-worker""#);
    assert!(matches!(c, Cond::Cmp(..)), "{c:?}");
    assert_eq!(why, [Untranslatable::FilterReadsBytes]);
    assert_eq!(why[0].to_string(), "the filter reads text or bytes");
    // Under a negation, what is left out takes nothing away either.
    let (c, _) = pre(r#"!(key.dport == 443 && value.comm == "x")"#);
    assert_eq!(c, Cond::Const(true));
    let (c, why) = pre(r#"value.comm == "x" || value.u8 + 1 == 2"#);
    assert_eq!(c, Cond::Const(true));
    assert_eq!(
        why,
        [
            Untranslatable::FilterReadsBytes,
            Untranslatable::FilterComputes
        ]
    );
    assert_eq!(why[1].to_string(), "the filter computes arithmetic");
}
