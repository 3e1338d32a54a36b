//! The shape of the code: the modules of each crate import each other
//! without cycles (`crate::` paths, test modules left out; a name any module
//! re-exports, `crate::Watch` or `crate::ops::Metrics`, counts as an import
//! of the module that defines it), and `unsafe` code lives in the kernel
//! crate only.

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

/// A use tree ("a::{b, c::{d as e, *}}"), expanded: each leaf's full path
/// and the name it is known by ("*" for a glob, "" for `self` of a
/// group's root).
fn expand(text: &str) -> Vec<(String, String)> {
    fn words(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut word = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            match c {
                ':' if chars.peek() == Some(&':') => {
                    chars.next();
                    out.push("::".into());
                }
                '{' | '}' | ',' | '*' => out.push(c.to_string()),
                _ => {}
            }
        }
        if !word.is_empty() {
            out.push(word);
        }
        out
    }
    fn tree(t: &[String], at: &mut usize, prefix: &str, out: &mut Vec<(String, String)>) {
        let mut path = prefix.to_owned();
        loop {
            match t.get(*at).map(String::as_str) {
                Some("{") => {
                    *at += 1;
                    while !matches!(t.get(*at).map(String::as_str), Some("}") | None) {
                        tree(t, at, &path, out);
                        if t.get(*at).map(String::as_str) == Some(",") {
                            *at += 1;
                        }
                    }
                    *at += 1;
                    return;
                }
                Some("*") => {
                    *at += 1;
                    out.push((path, "*".into()));
                    return;
                }
                Some("self") if t.get(*at + 1).map(String::as_str) != Some("::") => {
                    *at += 1;
                    let name = path.rsplit("::").next().unwrap_or("").to_owned();
                    out.push((path, name));
                    return;
                }
                Some(w) if w != "::" && w != "," && w != "}" => {
                    *at += 1;
                    if !path.is_empty() {
                        path.push_str("::");
                    }
                    path.push_str(w);
                    match t.get(*at).map(String::as_str) {
                        Some("::") => *at += 1,
                        Some("as") => {
                            let alias = t.get(*at + 1).cloned().unwrap_or_default();
                            *at += 2;
                            out.push((path, alias));
                            return;
                        }
                        _ => {
                            let name = w.to_owned();
                            out.push((path, name));
                            return;
                        }
                    }
                }
                _ => return,
            }
        }
    }
    let t = words(tree_text(text));
    let mut out = Vec::new();
    let mut at = 0;
    tree(&t, &mut at, "", &mut out);
    out
}

/// A use tree's text without what follows it.
fn tree_text(text: &str) -> &str {
    let mut depth = 0i32;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[..=i];
                }
            }
            ';' if depth == 0 => return &text[..i],
            c if depth == 0 && !(c.is_alphanumeric() || c == '_' || c == ':' || c == '*') => {
                return &text[..i];
            }
            _ => {}
        }
    }
    text
}

/// The paths, from the crate root, that a module's text names with
/// `crate::` (use trees expanded).
fn crate_paths(text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        if text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        paths.extend(expand(rest).into_iter().map(|(p, _)| p));
    }
    paths
}

/// What a module re-exports (`pub use`, `pub(crate) use`, ...): each name
/// to the path (from the crate root) it stands for, and the paths of its
/// glob re-exports.
#[derive(Debug, Default)]
struct Reexports {
    named: BTreeMap<String, String>,
    globs: Vec<String>,
}

/// A path written in `module` (relative: `super::`, `self::`, a child's
/// name; or from `crate::`) as a path from the crate root; `None` when it
/// leaves the crate.
fn absolute(module: &str, path: &str, modules: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    let mut base: Vec<&str> = module.split("::").filter(|p| !p.is_empty()).collect();
    if parts.first() == Some(&"crate") {
        return Some(parts[1..].join("::"));
    }
    while let Some(first) = parts.first() {
        match *first {
            "self" => {
                parts.remove(0);
            }
            "super" => {
                parts.remove(0);
                base.pop();
            }
            _ => break,
        }
    }
    let full = base
        .iter()
        .chain(&parts)
        .copied()
        .collect::<Vec<_>>()
        .join("::");
    let first = full.split("::").next().unwrap_or("");
    modules.contains_key(first).then_some(full)
}

/// Every module's re-exports.
fn reexports(
    texts: &BTreeMap<String, String>,
    modules: &BTreeMap<String, PathBuf>,
) -> BTreeMap<String, Reexports> {
    let mut out = BTreeMap::new();
    for (module, text) in texts {
        let mut r = Reexports::default();
        for statement in text.split(';') {
            let code = statement.trim_start();
            let Some(rest) = ["pub use ", "pub(crate) use ", "pub(super) use "]
                .iter()
                .find_map(|p| code.rsplit_once(p).map(|(_, r)| r))
            else {
                continue;
            };
            for (path, name) in expand(rest) {
                let Some(full) = absolute(module, &path, modules) else {
                    continue;
                };
                if name == "*" {
                    r.globs.push(full);
                } else if !name.is_empty() {
                    r.named.insert(name, full);
                }
            }
        }
        out.insert(module.clone(), r);
    }
    out
}

/// Whether a module's text defines `item`.
fn defines(text: &str, item: &str) -> bool {
    [
        "struct", "enum", "fn", "trait", "type", "const", "static", "mod", "union",
    ]
    .iter()
    .any(|kw| {
        text.match_indices(&format!("{kw} {item}")).any(|(at, m)| {
            let after = text[at + m.len()..].chars().next();
            !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

/// The module that defines what `path` (from the crate root) names,
/// following re-exports to the file that defines the name.
fn resolve(
    path: &str,
    modules: &BTreeMap<String, PathBuf>,
    texts: &BTreeMap<String, String>,
    reexported: &BTreeMap<String, Reexports>,
    depth: usize,
) -> Option<String> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    let k = (0..=parts.len())
        .rev()
        .find(|k| modules.contains_key(&parts[..*k].join("::")))?;
    let module = parts[..k].join("::");
    let Some(item) = parts.get(k) else {
        return Some(module);
    };
    if depth > 8 {
        return Some(module);
    }
    let r = &reexported[&module];
    if let Some(target) = r.named.get(*item) {
        let tail: Vec<&str> = std::iter::once(target.as_str())
            .chain(parts[k + 1..].iter().copied())
            .collect();
        return resolve(&tail.join("::"), modules, texts, reexported, depth + 1).or(Some(module));
    }
    if !defines(&texts[&module], item) {
        for g in &r.globs {
            if texts.get(g).is_some_and(|t| defines(t, item)) {
                return Some(g.clone());
            }
        }
    }
    Some(module)
}

/// Module -> the modules it imports (never its own parent or children), a
/// name imported through re-exports counted as an import of the module
/// that defines it.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeMap<String, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let texts: BTreeMap<String, String> = modules
        .iter()
        .map(|(name, file)| {
            let text = without_tests(&fs::read_to_string(file).expect("a source file"));
            // Comments (intra-doc links among them) import nothing.
            let code: Vec<&str> = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect();
            (name.clone(), code.join("\n"))
        })
        .collect();
    let reexported = reexports(&texts, &modules);
    let mut edges = BTreeMap::new();
    for (name, text) in &texts {
        let mut targets = BTreeSet::new();
        for path in crate_paths(text) {
            let Some(target) = resolve(&path, &modules, &texts, &reexported, 0) else {
                continue;
            };
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
        crate_paths(
            "use crate::{access::Policy, model::{Caller, MapRef as R}};\nx(crate::dump::spawn)"
        ),
        [
            "access::Policy",
            "model::Caller",
            "model::MapRef",
            "dump::spawn"
        ]
    );
    let modules: BTreeMap<String, PathBuf> = ["", "ops", "ops::metrics", "watch", "calls"]
        .into_iter()
        .map(|m| (m.to_owned(), PathBuf::new()))
        .collect();
    let texts: BTreeMap<String, String> = [
        ("", "mod ops;\npub use watch::{Scan, Watch as W};"),
        (
            "ops",
            "mod metrics;\npub(crate) use metrics::Metrics;\npub use self::metrics::*;",
        ),
        (
            "ops::metrics",
            "pub(crate) struct Metrics;\npub struct Gauge;",
        ),
        ("watch", "pub struct Scan;\npub struct Watch;"),
        (
            "calls",
            "use crate::{ops::Metrics, W};\nuse crate::ops::Gauge;",
        ),
    ]
    .into_iter()
    .map(|(m, t)| (m.to_owned(), t.to_owned()))
    .collect();
    let r = reexports(&texts, &modules);
    assert_eq!(r["ops"].named["Metrics"], "ops::metrics::Metrics");
    assert_eq!(r[""].named["W"], "watch::Watch");
    let to = |p: &str| resolve(p, &modules, &texts, &r, 0).unwrap();
    // Through a named re-export, a crate-root alias, and a glob.
    assert_eq!(to("ops::Metrics"), "ops::metrics");
    assert_eq!(to("W"), "watch");
    assert_eq!(to("ops::Gauge"), "ops::metrics");
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
