//! The README's library examples are the library's documentation examples,
//! which `cargo test` compiles: each ```rust block of the README's section
//! "The client library" must be one of them, line for line, without the
//! hidden (`# `) lines.

use std::path::Path;

/// The code blocks of the README's library section.
fn readme_blocks() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let start = readme
        .find("\n## The client library\n")
        .expect("a section \"The client library\"");
    let section = &readme[start + 1..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    fenced(section.lines(), |fence| fence == "rust")
}

/// The code blocks of the documentation in the library's sources, without
/// hidden lines.
fn doc_blocks() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut blocks = Vec::new();
    for file in std::fs::read_dir(&src).expect("src/") {
        let path = file.expect("an entry of src/").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a source file");
        let docs = text.lines().filter_map(|l| {
            let l = l.trim_start();
            l.strip_prefix("//!").or_else(|| l.strip_prefix("///"))
        });
        let docs = docs.map(|l| l.strip_prefix(' ').unwrap_or(l));
        let code = fenced(docs, |fence| matches!(fence, "" | "rust" | "no_run"));
        blocks.extend(code.into_iter().map(|b| {
            b.lines()
                .filter(|l| *l != "#" && !l.starts_with("# "))
                .map(|l| format!("{l}\n"))
                .collect()
        }));
    }
    blocks
}

/// The bodies of the fenced blocks whose info string `keep` accepts.
fn fenced<'a>(lines: impl Iterator<Item = &'a str>, keep: impl Fn(&str) -> bool) -> Vec<String> {
    // Inside a block: `Some(body)` when it is kept, `None` when skipped.
    let (mut blocks, mut inside): (Vec<String>, Option<Option<String>>) = (Vec::new(), None);
    for line in lines {
        match (inside.as_mut(), line.strip_prefix("```")) {
            (None, Some(info)) => inside = Some(keep(info.trim()).then(String::new)),
            (None, None) => {}
            (Some(_), Some(_)) => blocks.extend(inside.take().flatten()),
            (Some(Some(body)), None) => {
                body.push_str(line);
                body.push('\n');
            }
            (Some(None), None) => {}
        }
    }
    blocks
}

#[test]
fn every_readme_example_is_a_compiled_doc_example() {
    let readme = readme_blocks();
    assert!(
        !readme.is_empty(),
        "the README's library section has no example: {readme:?}"
    );
    let docs = doc_blocks();
    for block in &readme {
        assert!(
            docs.contains(block),
            "this README example is not a documentation example of the library (line for line, hidden lines left out):\n{block}"
        );
    }
}
