//! The fuzz targets (`tests/fuzz`, libFuzzer) run on stable Rust: the same
//! bodies over seeds and thousands of deterministic mutations of them, and
//! over random type descriptions. They fail on a panic, a hang (the test
//! times out) or decoded text that is not JSON.

use bpfmap_kernel::{BtfBuilder, BtfMember as M, IntEncoding as E};
use bpfmap_proto::v1::{
    ArrayType, EnumType, Enumerator, IntType, Member, PointerType, RecordType, TypeInfo,
    type_info::Kind,
};
use bpfmap_tests::{Rng, fuzz};
use prost::Message as _;

/// A few bytes changed, inserted, removed or cut.
fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut data = seed.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(data.len() as u64 + 1) as usize;
        match rng.below(5) {
            0 if at < data.len() => data[at] = rng.next() as u8,
            1 if at < data.len() => data[at] ^= 1 << rng.below(8),
            2 => data.insert(at, rng.next() as u8),
            3 if at < data.len() => {
                data.remove(at);
            }
            _ => data.truncate(at),
        }
    }
    data
}

/// BTF with one type of every kind the describer handles.
fn btf_seed() -> Vec<u8> {
    let mut b = BtfBuilder::new();
    let u8_ = b.add_int("unsigned char", 1, E::Unsigned);
    let s32 = b.add_int("int", 4, E::Signed);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
    let c = b.add_int("char", 1, E::Signed);
    let t = b.add_typedef("__u32", s32);
    let k = b.add_const(t);
    let name = b.add_array(c, 8);
    let e = b.add_enum("e", 4, true, &[("A", -1), ("B", 2)]);
    let e64 = b.add_enum64("e64", 8, false, &[("BIG", u64::MAX)]);
    let fwd = b.add_fwd("node", false);
    let p = b.add_ptr(fwd);
    let f = b.add_float("double", 8);
    let inner = b.add_union("", 4, &[M::new("x", s32, 0), M::new("y", u8_, 0)]);
    b.add_struct(
        "all",
        48,
        &[
            M::new("a", u8_, 0),
            M::bitfield("b", s32, 8, 5),
            M::new("c", k, 32),
            M::new("name", name, 64),
            M::new("e", e, 128),
            M::new("", inner, 160),
            M::new("e64", e64, 192),
            M::new("p", p, 256),
            M::new("f", f, 320),
        ],
    );
    b.add_struct("loop", 8, &[M::new("next", p, 0)]);
    let _ = u64_;
    b.to_bytes()
}

#[test]
fn btf_through_the_describer_and_the_decoder() {
    let seed = btf_seed();
    fuzz::btf_describe(&seed);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        fuzz::btf_describe(&mutate(&seed, &mut rng));
    }
    for len in 0..seed.len() {
        fuzz::btf_describe(&seed[..len]);
    }
}

fn int(size: u32, signed: bool) -> TypeInfo {
    TypeInfo {
        name: String::new(),
        size,
        kind: Some(Kind::Int(IntType {
            signed,
            big_endian: false,
        })),
    }
}

/// A random description, often wrong: sizes, offsets and lengths come
/// from the generator, not from a compiler.
fn random_type(rng: &mut Rng, depth: u32) -> TypeInfo {
    let leaf = depth >= 4 || rng.below(3) == 0;
    match if leaf { rng.below(3) } else { 3 + rng.below(3) } {
        0 => int(
            [1, 2, 4, 8, 16, 3][rng.below(6) as usize],
            rng.below(2) == 0,
        ),
        1 => TypeInfo {
            name: "e".into(),
            size: [1, 2, 4, 8][rng.below(4) as usize],
            kind: Some(Kind::Enum(EnumType {
                signed: rng.below(2) == 0,
                enumerators: (0..rng.below(4))
                    .map(|i| Enumerator {
                        name: format!("V{i}"),
                        value: rng.next() as i64 % 8,
                    })
                    .collect(),
            })),
        },
        2 => TypeInfo {
            name: String::new(),
            size: 8,
            kind: Some(Kind::Pointer(PointerType { target: "x".into() })),
        },
        3 | 4 => {
            let members: Vec<Member> = (0..rng.below(5))
                .map(|i| {
                    let t = random_type(rng, depth + 1);
                    let bitfield = if rng.below(4) == 0 {
                        rng.below(70) as u32
                    } else {
                        0
                    };
                    Member {
                        name: if rng.below(6) == 0 {
                            String::new()
                        } else {
                            format!("m{i}")
                        },
                        bit_offset: rng.below(256) as u32,
                        bitfield_size: bitfield,
                        r#type: Some(t),
                    }
                })
                .collect();
            TypeInfo {
                name: "r".into(),
                size: rng.below(48) as u32,
                kind: Some(if rng.below(4) == 0 {
                    Kind::Union(RecordType { members })
                } else {
                    Kind::Struct(RecordType { members })
                }),
            }
        }
        _ => {
            let element = random_type(rng, depth + 1);
            let length = rng.below(6) as u32;
            TypeInfo {
                name: String::new(),
                size: if rng.below(3) == 0 {
                    rng.below(64) as u32
                } else {
                    element.size.saturating_mul(length)
                },
                kind: Some(Kind::Array(Box::new(ArrayType {
                    element: Some(Box::new(element)),
                    length,
                }))),
            }
        }
    }
}

#[test]
fn random_descriptions_and_bytes_through_the_decoder() {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let mut usable = 0;
    for _ in 0..20_000 {
        let info = random_type(&mut rng, 0);
        let bytes: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
        if bpfmap_proto::typed::Layout::new(&info, "value").is_ok() {
            usable += 1;
        }
        fuzz::decode_through(&info, &bytes);
        // And as a server would send it, mutated on the way.
        let mut wire = vec![0u8];
        let encoded = info.encode_to_vec();
        wire[0] = (encoded.len() / 4).min(255) as u8;
        wire.extend_from_slice(&encoded);
        wire.extend_from_slice(&bytes);
        fuzz::typed_decode(&mutate(&wire, &mut rng));
    }
    // The generator reaches the decoder, not only the checks before it.
    assert!(usable > 500, "only {usable} descriptions were usable");
}

/// Every seed compiles against the typed shape (else the mutations would
/// mostly try the parser's errors).
#[test]
fn the_filter_seeds_compile() {
    let layouts = [0, 1, 2].map(fuzz::filter_layout);
    for seed in fuzz::FILTER_SEEDS {
        let results = layouts
            .iter()
            .map(|l| bpfmapd::query::Filter::compile(seed, l))
            .collect::<Vec<_>>();
        assert!(results.iter().any(Result::is_ok), "{seed}: {results:?}");
    }
}

/// A filter input: shape, source, NUL, entry bytes.
fn filter_input(which: u8, source: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut data = vec![which];
    data.extend_from_slice(source);
    data.push(0);
    data.extend((0..rng.below(200)).map(|_| rng.next() as u8));
    data
}

#[test]
fn mutated_filters_through_the_compiler_and_the_evaluator() {
    let mut rng = Rng(0x5eed_f11e_0000_0001);
    for seed in fuzz::FILTER_SEEDS {
        for which in 0..3 {
            fuzz::filter_eval(&filter_input(which, seed.as_bytes(), &mut rng));
        }
    }
    for _ in 0..20_000 {
        let seed = fuzz::FILTER_SEEDS[rng.below(fuzz::FILTER_SEEDS.len() as u64) as usize];
        let source = mutate(seed.as_bytes(), &mut rng);
        let which = rng.below(3) as u8;
        fuzz::filter_eval(&filter_input(which, &source, &mut rng));
    }
}

/// Tokens random expressions are made of: members, literals, operators,
/// functions and brackets, in any order (most do not parse; those that do
/// reach the checker with types that often do not fit).
const TOKENS: &[&str] = &[
    "key",
    "value",
    "values[1]",
    ".dport",
    ".saddr",
    ".proto",
    ".comm",
    ".packets",
    ".bytes",
    ".lo",
    ".hi",
    ".flags",
    ".level",
    ".ok",
    ".counters",
    ".wide",
    "[0]",
    "[3]",
    "[9]",
    "0",
    "1",
    "-1",
    "443",
    "18446744073709551615u",
    "9223372036854775807",
    "\"IPPROTO_UDP\"",
    "\"x\"",
    "b\"\\x01\"",
    "true",
    "false",
    "null",
    "1.5",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "+",
    "-",
    "*",
    "/",
    "%",
    "&&",
    "||",
    "!",
    "?",
    ":",
    "in",
    "[",
    "]",
    "(",
    ")",
    ",",
    ".startsWith(\"a\")",
    ".matches(\"(a*)*b\")",
    ".size()",
    "size(",
    ".u32(0)",
    ".be16(2)",
    ".exists(x, x > 0)",
    "has(",
    "{",
    "}",
    "x",
];

/// A random expression from a small grammar: members and literals,
/// compared, combined, negated and chosen between, often of types that do
/// not fit.
fn grammar(rng: &mut Rng, depth: u32) -> String {
    const OPERANDS: &[&str] = &[
        "key.dport",
        "key.saddr",
        "key.proto",
        "value.packets",
        "value.bytes",
        "value.lo",
        "value.hi",
        "value.flags",
        "value.level",
        "value.counters[1]",
        "value.wide",
        "1",
        "-7",
        "443",
        "\"IPPROTO_TCP\"",
        "value.comm",
        "\"nginx\"",
        "value.ok",
        "true",
        "values[2].packets",
        "value.comm.size()",
    ];
    const COMPARE: &[&str] = &["==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/", "%"];
    let pick = |rng: &mut Rng, xs: &[&str]| xs[rng.below(xs.len() as u64) as usize].to_owned();
    if depth >= 4 || rng.below(3) == 0 {
        let (a, b) = (pick(rng, OPERANDS), pick(rng, OPERANDS));
        return format!("{a} {} {b}", pick(rng, COMPARE));
    }
    match rng.below(5) {
        0 => format!(
            "({} && {})",
            grammar(rng, depth + 1),
            grammar(rng, depth + 1)
        ),
        1 => format!(
            "({} || {})",
            grammar(rng, depth + 1),
            grammar(rng, depth + 1)
        ),
        2 => format!("!({})", grammar(rng, depth + 1)),
        3 => format!(
            "({} ? {} : {})",
            grammar(rng, depth + 1),
            grammar(rng, depth + 1),
            grammar(rng, depth + 1)
        ),
        _ => format!("{} in [1, 443, \"IPPROTO_UDP\"]", pick(rng, OPERANDS)),
    }
}

#[test]
fn random_expressions_through_the_compiler_and_the_evaluator() {
    let mut rng = Rng(0x0fed_cba9_8765_4321);
    let mut compiled = 0;
    for i in 0..20_000 {
        let n = 1 + rng.below(24);
        let source: String = if i % 2 == 0 {
            grammar(&mut rng, 0)
        } else {
            (0..n)
                .map(|_| TOKENS[rng.below(TOKENS.len() as u64) as usize])
                .collect::<Vec<_>>()
                .join(if rng.below(2) == 0 { " " } else { "" })
        };
        let which = rng.below(3) as u8;
        if bpfmapd::query::Filter::compile(&source, &fuzz::filter_layout(0)).is_ok() {
            compiled += 1;
        }
        fuzz::filter_eval(&filter_input(which, source.as_bytes(), &mut rng));
    }
    assert!(
        compiled > 1000,
        "only {compiled} of 20,000 random expressions compiled"
    );
}
