//! The shape of the code: the modules of each crate import each other
//! without cycles (`crate::` paths, test modules left out; a name the
//! crate root re-exports, `crate::Watch`, counts as an import of the module
//! it comes from), and `unsafe` code lives in the kernel crate only.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// The workspace's crates with a `src/` folder.
const CRATES: [&str; 6] = [
    "server",
    "server/kernel",
    "server/relay",
    "proto",
    "client/lib",
    "client/bpfmapctl",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

/// Every `.rs` file below `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A file's module path ("dump::producer"; "" for lib.rs and main.rs).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file
        .strip_prefix(src)
        .expect("below src")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// `text` without its `#[cfg(test)] mod NAME { ... }` blocks.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_mod = trimmed.starts_with("mod ") || trimmed.starts_with("pub(crate) mod ");
        out.push_str(&rest[..at]);
        let Some(open) = after.find('{').filter(|_| is_mod) else {
            rest = after;
            continue;
        };
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The `crate::` paths a text names ("dump::CursorKey", "model").
fn crate_paths(text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let word = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    for (at, _) in text.match_indices("crate::") {
        if text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find(';').unwrap_or(group.len());
            paths.extend(
                group[..end]
                    .split(|c: char| !word(c))
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
        } else {
            let end = rest.find(|c: char| !word(c)).unwrap_or(rest.len());
            paths.push(rest[..end].trim_end_matches(':').to_owned());
        }
    }
    paths
}

/// The names a crate root re-exports from its modules (`pub use
/// watch::{Scan, Watch}`: "Watch" -> "watch").
fn reexports(root: &str, modules: &BTreeMap<String, PathBuf>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for statement in root.split(';') {
        let code: Vec<&str> = statement
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && !l.starts_with("#["))
            .collect();
        let code = code.join(" ");
        let code = code.trim();
        let Some(rest) = ["pub use ", "pub(crate) use "]
            .iter()
            .find_map(|p| code.strip_prefix(p))
        else {
            continue;
        };
        let module = rest.split("::").next().unwrap_or("").trim();
        if !modules.contains_key(module) || module.is_empty() {
            continue;
        }
        for item in rest[module.len()..].split([',', '{', '}']) {
            let item = item.trim().trim_start_matches("::");
            let name = item.rsplit(" as ").next().unwrap_or("");
            let name = name.rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() && name != "self" {
                out.insert(name.to_owned(), module.to_owned());
            }
        }
    }
    out
}

/// Module -> the modules it imports (never its own parent or children).
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeMap<String, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let root = modules
        .get("")
        .map(|f| fs::read_to_string(f).expect("the crate root"))
        .unwrap_or_default();
    let reexported = reexports(&root, &modules);
    let mut edges = BTreeMap::new();
    for (name, file) in &modules {
        let text = without_tests(&fs::read_to_string(file).expect("a source file"));
        // Comments (intra-doc links among them) import nothing.
        let text: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut targets = BTreeSet::new();
        for path in crate_paths(&text) {
            let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
            let target = (1..=parts.len())
                .rev()
                .map(|k| parts[..k].join("::"))
                .find(|cand| modules.contains_key(cand))
                .or_else(|| reexported.get(*parts.first()?).cloned());
            let Some(target) = target else { continue };
            let related = *name == target
                || name.starts_with(&format!("{target}::"))
                || target.starts_with(&format!("{name}::"));
            if !related && !target.is_empty() {
                targets.insert(target);
            }
        }
        edges.insert(name.clone(), targets);
    }
    edges
}

/// A cycle through `from`, if there is one.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        edges: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut found = path[i..].to_vec();
            found.push(at.to_owned());
            return Some(found);
        }
        if !done.insert(at.to_owned()) {
            return None;
        }
        path.push(at.to_owned());
        for next in edges.get(at).into_iter().flatten() {
            if let Some(c) = walk(edges, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    walk(edges, from, &mut Vec::new(), &mut BTreeSet::new())
}

#[test]
fn the_modules_of_every_crate_import_each_other_without_cycles() {
    for krate in CRATES {
        let edges = graph(&root().join(krate).join("src"));
        assert!(
            edges.len() > 1 || krate != "server",
            "no modules found in {krate}"
        );
        for module in edges.keys() {
            if let Some(c) = cycle(&edges, module) {
                panic!("{krate}: modules in a cycle: {}", c.join(" -> "));
            }
        }
    }
}

#[test]
fn the_cycle_check_finds_a_cycle() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(cycle(&edges, "a").unwrap(), ["a", "b", "c", "a"]);
    assert_eq!(cycle(&edges, "d"), None);
    assert_eq!(
        crate_paths("use crate::{access::Policy, model::{Caller, MapRef}};\nx(crate::dump::spawn)"),
        [
            "access::Policy",
            "model::",
            "Caller",
            "MapRef",
            "dump::spawn"
        ]
    );
    let modules: BTreeMap<String, PathBuf> = ["", "watch", "client"]
        .into_iter()
        .map(|m| (m.to_owned(), PathBuf::new()))
        .collect();
    let root = "mod watch;\n/// Watches.\npub use watch::{Scan, Watch as W, x::Y};\npub use client::Client;";
    let names = reexports(root, &modules);
    assert_eq!(names["W"], "watch");
    assert_eq!(names["Y"], "watch");
    assert_eq!(names["Client"], "client");
    let stripped = without_tests("a\n#[cfg(test)]\nmod tests {\n use crate::x; { }\n}\nb");
    assert!(
        !stripped.contains("crate::x") && stripped.contains('b'),
        "{stripped}"
    );
}

#[test]
fn unsafe_code_lives_in_the_kernel_crate_only() {
    for krate in CRATES.iter().filter(|k| **k != "server/kernel") {
        let src = root().join(krate).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        for file in files {
            let text = fs::read_to_string(&file).expect("a source file");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                let has = code
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .any(|w| w == "unsafe");
                let forbids = code.contains("forbid(unsafe_code)");
                assert!(
                    !has || forbids,
                    "{}:{}: unsafe outside the kernel crate: {line}",
                    file.display(),
                    n + 1
                );
            }
        }
        let lib = ["lib.rs", "main.rs"]
            .iter()
            .map(|f| src.join(f))
            .filter(|f| f.exists())
            .collect::<Vec<_>>();
        for f in lib {
            assert!(
                fs::read_to_string(&f)
                    .unwrap()
                    .contains("#![forbid(unsafe_code)]"),
                "{} does not forbid unsafe code",
                f.display()
            );
        }
    }
}
