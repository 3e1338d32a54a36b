//! What bpftrace's scripts say of their maps. bpftrace 0.17 gives its maps
//! no types and names `@x` `AT_x`: which function keeps a map (count(),
//! min(), hist() ...), lhist()'s bounds and the key's expressions are only
//! in the script. The daemon reads the script of each bpftrace process
//! holding a map (its `-e PROGRAM`, or the script file it names) and finds
//! the map's assignments there.

use std::{collections::HashMap, path::Path, sync::LazyLock};

use bpfmap_proto::v1 as pb;
use regex::Regex;

/// A bpftrace process's script: where it was read and what it says of
/// each map, by the name after `@` ("" for `@`).
#[derive(Debug, Default)]
pub(crate) struct Script {
    maps: HashMap<String, pb::BpftraceScript>,
}

/// bpftrace's options that take a value (the script is not among them).
const WITH_VALUE: [&str; 9] = [
    "-o",
    "-p",
    "-c",
    "-I",
    "-B",
    "-f",
    "--include",
    "--usdt-file-activation",
    "--info",
];

impl Script {
    /// The script of bpftrace process `pid`, from `/proc`; `None` when its
    /// command line or script file cannot be read.
    pub(crate) fn of_process(proc: &Path, pid: u32) -> Option<Self> {
        let dir = proc.join(pid.to_string());
        let cmdline = std::fs::read(dir.join("cmdline")).ok()?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let (source, text) = script_text(&args, &dir)?;
        Some(Self::parse(&source, &text))
    }

    /// What `text` (read from `source`) says of its maps.
    pub(crate) fn parse(source: &str, text: &str) -> Self {
        static ASSIGN: LazyLock<Regex> = LazyLock::new(|| {
            Regex::new(
                r"@([A-Za-z_][A-Za-z0-9_]*)?\s*(?:\[([^\]]*)\])?\s*=\s*(?:(count|sum|min|max|avg|stats|hist|lhist)\s*\(([^;{}]*)\))?",
            )
            .expect("a valid expression")
        });
        let text = strip_comments(text);
        let mut maps: HashMap<String, pb::BpftraceScript> = HashMap::new();
        for c in ASSIGN.captures_iter(&text) {
            // `@x == 1` compares, `@x[k] = ...` assigns.
            let end = c.get(0).expect("the match").end();
            if text[..end].ends_with('=') && text[end..].starts_with('=') {
                continue;
            }
            let name = c.get(1).map_or("", |m| m.as_str()).to_owned();
            let key = c.get(2).map_or("", |m| m.as_str().trim()).to_owned();
            let function = c.get(3).map_or("", |m| m.as_str()).to_owned();
            let mut found = pb::BpftraceScript {
                key_type: key_type(&key).unwrap_or_default(),
                key,
                function,
                script: source.to_owned(),
                ..Default::default()
            };
            if found.function == "lhist" {
                let args = split_top(c.get(4).map_or("", |m| m.as_str()));
                if let [_, min, max, step] = args.as_slice()
                    && let (Ok(min), Ok(max), Ok(step)) = (min.parse(), max.parse(), step.parse())
                {
                    (found.min, found.max, found.step) = (min, max, step);
                }
            }
            // The first assignment with a function says what keeps it.
            match maps.get(&name) {
                Some(known) if !known.function.is_empty() || found.function.is_empty() => {}
                _ => {
                    maps.insert(name, found);
                }
            }
        }
        Self { maps }
    }

    /// What the script says of the map named `kernel_name` (`AT_x`; the
    /// kernel keeps 15 bytes of it, so a cut name matches the one longer
    /// name it starts), checked against the map's key size.
    pub(crate) fn map(&self, kernel_name: &str, key_size: u32) -> Option<pb::BpftraceScript> {
        let name = kernel_name.strip_prefix("AT_")?;
        let found = match self.maps.get(name) {
            Some(m) => m,
            None if kernel_name.len() >= 15 => {
                let mut longer = self.maps.iter().filter(|(n, _)| n.starts_with(name));
                match (longer.next(), longer.next()) {
                    (Some((_, m)), None) => m,
                    _ => return None,
                }
            }
            None => return None,
        };
        let mut found = found.clone();
        let indexed = matches!(found.function.as_str(), "avg" | "stats" | "hist" | "lhist");
        let key_size = key_size.saturating_sub(if indexed { 8 } else { 0 });
        if !found.key_type.is_empty() && key_bytes(&found.key) != Some(key_size as usize) {
            found.key_type.clear();
        }
        Some(found)
    }
}

/// The script a bpftrace command line runs: `-e PROGRAM`, else the file
/// it names (relative to the process's working directory, inside its
/// root).
fn script_text(args: &[String], dir: &Path) -> Option<(String, String)> {
    let mut i = 1;
    let mut file = None;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "-e" {
            return Some(("-e".into(), args.get(i + 1)?.clone()));
        }
        if let Some(p) = a
            .strip_prefix("-e")
            .filter(|p| !p.is_empty() && !a.starts_with("--"))
        {
            return Some(("-e".into(), p.to_owned()));
        }
        if a == "--" {
            file = file.or(args.get(i + 1).cloned());
            break;
        }
        if WITH_VALUE.contains(&a) {
            i += 2;
            continue;
        }
        if !a.starts_with('-') && file.is_none() {
            file = Some(a.to_owned());
        }
        i += 1;
    }
    let file = file?;
    let path = if Path::new(&file).is_absolute() {
        dir.join("root").join(file.trim_start_matches('/'))
    } else {
        dir.join("cwd").join(&file)
    };
    // A script is small; anything larger is not one.
    let meta = std::fs::metadata(&path).ok()?;
    if !meta.is_file() || meta.len() > 1 << 20 {
        return None;
    }
    Some((file, std::fs::read_to_string(path).ok()?))
}

/// `text` without `//` and `/* */` comments (strings kept).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (c, chars.peek(), quoted) {
            ('"', _, _) => {
                quoted = !quoted;
                out.push(c);
            }
            ('\\', Some(_), true) => {
                out.push(c);
                out.extend(chars.next());
            }
            ('/', Some('/'), false) => {
                for n in chars.by_ref() {
                    if n == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('/', Some('*'), false) => {
                chars.next();
                let mut last = ' ';
                for n in chars.by_ref() {
                    if last == '*' && n == '/' {
                        break;
                    }
                    last = n;
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

/// `text` split at its top-level commas, each part trimmed.
fn split_top(text: &str) -> Vec<String> {
    let (mut parts, mut depth, mut part) = (Vec::new(), 0i32, String::new());
    for c in text.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut part).trim().to_owned());
                continue;
            }
            _ => {}
        }
        part.push(c);
    }
    if !part.trim().is_empty() || !parts.is_empty() {
        parts.push(part.trim().to_owned());
    }
    parts
}

/// bpftrace's builtins whose values are not integers (their size in a
/// key is not known here).
const NOT_INTEGERS: [&str; 14] = [
    "probe",
    "func",
    "ksym",
    "usym",
    "buf",
    "ntop",
    "username",
    "cgroup_path",
    "path",
    "macaddr",
    "strftime",
    "kaddr",
    "uaddr",
    "@",
];

/// One key expression's member: its C declaration (name in it) and size.
fn member(expr: &str, index: usize, alone: bool) -> Option<(String, usize)> {
    let call = expr.split('(').next().unwrap_or(expr).trim();
    let name = if alone {
        String::new()
    } else {
        let ident: String = expr
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect::<String>()
            .split('_')
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join("_");
        match ident.chars().next() {
            Some(c) if c.is_ascii_alphabetic() && ident.len() <= 32 => ident,
            _ => format!("k{index}"),
        }
    };
    let decl = |ty: &str, dims: &str| {
        if alone {
            format!("{ty}{dims}")
        } else {
            format!("{ty} {name}{dims}")
        }
    };
    Some(match call {
        "comm" => (decl("char", "[16]"), 16),
        "kstack" | "ustack" => (decl("__u64", ""), 8),
        // bpftrace's default string size.
        "str" => (decl("char", "[64]"), 64),
        c if NOT_INTEGERS.iter().any(|n| c.starts_with(n)) || expr.contains('"') => return None,
        _ => (decl("__s64", ""), 8),
    })
}

/// The key's C type, when every expression's is known.
fn key_type(key: &str) -> Option<String> {
    let exprs = split_top(key);
    match exprs.as_slice() {
        [] => None,
        [one] => member(one, 0, true).map(|(d, _)| d),
        many => {
            let members = many
                .iter()
                .enumerate()
                .map(|(i, e)| member(e, i, false).map(|(d, _)| d))
                .collect::<Option<Vec<_>>>()?;
            Some(format!("struct {{ {}; }}", members.join("; ")))
        }
    }
}

/// The size of the key's expressions (0 without keys).
fn key_bytes(key: &str) -> Option<usize> {
    let exprs = split_top(key);
    let alone = exprs.len() == 1;
    exprs
        .iter()
        .enumerate()
        .map(|(i, e)| member(e, i, alone).map(|(_, n)| n))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = r#"
        // Per command.
        tracepoint:syscalls:sys_enter_lseek /comm == "a//b"/ {
            @c[comm] = count(); @mn[args->whence] = min(args->offset);
            @st[comm, pid] = stats(args->offset); /* @no = count(); */
            @lat = lhist(args->offset, 0, 400, 50); @h = hist(args->offset);
            @[kstack] = count(); @u[ustack, comm] = sum(1);
            @start[tid] = nsecs; @a_very_long_name_here = avg(1);
            if (@start[tid] == 0) { @p[probe] = count(); }
        }
    "#;

    #[test]
    fn scripts_say_what_keeps_each_map_and_its_key() {
        let s = Script::parse("-e", SCRIPT);
        let get = |name: &str, size: u32| s.map(name, size).unwrap();
        let c = get("AT_c", 16);
        assert_eq!(
            (c.function.as_str(), c.key.as_str(), c.key_type.as_str()),
            ("count", "comm", "char[16]")
        );
        assert_eq!(c.script, "-e");
        let mn = get("AT_mn", 8);
        assert_eq!(
            (mn.function.as_str(), mn.key_type.as_str()),
            ("min", "__s64")
        );
        let st = get("AT_st", 32);
        assert_eq!(st.function, "stats");
        assert_eq!(st.key_type, "struct { char comm[16]; __s64 pid; }");
        let lat = get("AT_lat", 8);
        assert_eq!(
            (lat.function.as_str(), lat.min, lat.max, lat.step),
            ("lhist", 0, 400, 50)
        );
        assert_eq!((lat.key.as_str(), lat.key_type.as_str()), ("", ""));
        assert_eq!(get("AT_h", 8).function, "hist");
        let anonymous = get("AT_", 8);
        assert_eq!(
            (anonymous.key.as_str(), anonymous.key_type.as_str()),
            ("kstack", "__u64")
        );
        assert_eq!(
            get("AT_u", 24).key_type,
            "struct { __u64 ustack; char comm[16]; }"
        );
        // A plain value; a comparison is not an assignment.
        let start = get("AT_start", 8);
        assert_eq!(
            (start.function.as_str(), start.key_type.as_str()),
            ("", "__s64")
        );
        // The kernel keeps 15 bytes of a name.
        assert_eq!(get("AT_a_very_long_", 16).function, "avg");
        // Unknown key types, commented out maps, sizes that differ.
        assert_eq!(get("AT_p", 8).key_type, "");
        assert!(s.map("AT_no", 8).is_none());
        assert_eq!(get("AT_c", 64).key_type, "");
        assert!(s.map("c", 16).is_none());
    }

    #[test]
    fn the_script_is_found_on_the_command_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("cwd")).unwrap();
        std::fs::write(dir.path().join("cwd/t.bt"), "BEGIN { @x = count(); }").unwrap();
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let (src, text) =
            script_text(&args(&["bpftrace", "-q", "-o", "out", "t.bt"]), dir.path()).unwrap();
        assert_eq!(
            (src.as_str(), text.as_str()),
            ("t.bt", "BEGIN { @x = count(); }")
        );
        let (src, text) = script_text(
            &args(&["bpftrace", "-e", "BEGIN { @y = sum(1); }"]),
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            (src.as_str(), text.as_str()),
            ("-e", "BEGIN { @y = sum(1); }")
        );
        assert!(script_text(&args(&["bpftrace", "-l"]), dir.path()).is_none());
    }
}
