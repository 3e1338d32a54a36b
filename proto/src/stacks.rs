//! Stacks (StackMap): when two stacks are one (the daemon merging stack
//! ids that name the same frames, a fleet merging hosts), and the folded
//! form flame graphs read (`root;frame;frame count`, as flamegraph.pl,
//! inferno and speedscope take it).

use std::collections::BTreeMap;

use prost::Message as _;

use crate::v1::{self as pb, LostStack};

/// What makes two stacks one: their roots, the frames they name (a frame
/// without a name by its address) and how their ids were lost.
pub fn identity(s: &pb::Stack) -> Vec<String> {
    let mut k = s.roots.clone();
    k.push(format!("u{}", s.user_lost));
    k.extend(s.user.iter().map(frame_identity));
    k.push(format!("k{}", s.kernel_lost));
    k.extend(s.kernel.iter().map(frame_identity));
    k
}

/// What makes two frames one in [`identity`]: the function and its
/// module, or for a frame without a name its address.
pub fn frame_identity(f: &pb::Frame) -> String {
    match f.function.is_empty() {
        true => frame_label(f),
        false => format!("{} {}", f.module, f.function),
    }
}

/// Stacks from several answers (hosts) merged: the values of stacks that
/// are one added, exactly; the heaviest first, then by frames.
pub fn merge<'a>(answers: impl IntoIterator<Item = &'a pb::Stack>) -> Vec<pb::Stack> {
    let mut merged: BTreeMap<Vec<String>, (pb::Stack, i128)> = BTreeMap::new();
    for s in answers {
        let v: i128 = s.value.parse().unwrap_or(0);
        let e = merged.entry(identity(s)).or_insert_with(|| (s.clone(), 0));
        e.1 = e.1.saturating_add(v);
    }
    let mut out: Vec<(Vec<String>, pb::Stack, i128)> =
        merged.into_iter().map(|(k, (s, v))| (k, s, v)).collect();
    out.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    out.into_iter()
        .map(|(_, s, v)| pb::Stack {
            value: v.to_string(),
            ..s
        })
        .collect()
}

/// A frame without a name: its address, or where a stack map kept by
/// build ID left it (`<build id>+0x<offset>`).
pub fn frame_label(f: &pb::Frame) -> String {
    match (f.address, f.build_id.is_empty()) {
        (0, false) => format!("{}+{:#x}", f.build_id, f.file_offset),
        (a, _) => format!("{a:#x}"),
    }
}

/// A frame's name in a folded line: its function (`_[k]` after a kernel
/// one, as flamegraph.pl colours them), or its address; `;` cannot be in
/// a frame.
fn folded_frame(f: &pb::Frame, kernel: bool) -> String {
    let name = match f.function.is_empty() {
        true => frame_label(f),
        false => f.function.replace(';', ":"),
    };
    match kernel {
        true => format!("{name}_[k]"),
        false => name,
    }
}

/// One stack as a folded line: its roots, user frames, kernel frames
/// (outermost first), then its value. A stack lost by a hash collision or
/// another error shows as bcc's offcputime shows it (`[Missed User
/// Stack]`); no user stack at all (a kernel thread) shows nothing.
pub fn folded_line(s: &pb::Stack) -> String {
    let missed = |l: i32| {
        matches!(
            LostStack::try_from(l),
            Ok(LostStack::Eexist | LostStack::Other)
        )
    };
    let mut parts: Vec<String> = s.roots.iter().map(|r| r.replace(';', ":")).collect();
    if missed(s.user_lost) {
        parts.push("[Missed User Stack]".into());
    }
    parts.extend(s.user.iter().map(|f| folded_frame(f, false)));
    if missed(s.kernel_lost) {
        parts.push("[Missed Kernel Stack]".into());
    }
    parts.extend(s.kernel.iter().map(|f| folded_frame(f, true)));
    if parts.is_empty() {
        parts.push("[no frames]".into());
    }
    format!("{} {}", parts.join(";"), s.value)
}

/// What an answer keeps besides its stacks (notes, summary, names).
const ANSWER_MARGIN: usize = 256 << 10;

/// Stacks taken into one answer of at most a message's bytes, heaviest
/// first, until the next would not fit.
#[derive(Debug)]
pub struct Fitting {
    budget: usize,
    used: usize,
    max_message_bytes: usize,
}

impl Fitting {
    /// For answers of at most `max_message_bytes`.
    pub fn new(max_message_bytes: usize) -> Self {
        Self {
            budget: max_message_bytes.saturating_sub(ANSWER_MARGIN),
            used: 0,
            max_message_bytes,
        }
    }

    /// Whether `s` fits after those taken (it is then taken).
    pub fn take(&mut self, s: &pb::Stack) -> bool {
        let len = s.encoded_len();
        let used = self.used + len + prost::length_delimiter_len(len) + 1;
        if used > self.budget {
            return false;
        }
        self.used = used;
        true
    }

    /// What an answer that holds `kept` of `total` stacks says: all would
    /// take about their average size each.
    pub fn note(&self, kept: usize, total: usize) -> String {
        let all = self.used as u128 * total as u128 / kept.max(1) as u128;
        format!(
            "the answer holds the heaviest {kept} of {total} stacks: all of them would take about {} MiB, over the server's limit on a message (limits.max_message_bytes, {} MiB); ask for fewer (limit) or for fewer entries (filter)",
            all >> 20,
            self.max_message_bytes >> 20
        )
    }
}

/// Keeps the heaviest stacks (they come heaviest first) that fit in one
/// answer of at most `max_message_bytes`; what was left out, said.
pub fn fit(stacks: &mut Vec<pb::Stack>, max_message_bytes: usize) -> Option<String> {
    let mut fitting = Fitting::new(max_message_bytes);
    let keep = stacks.iter().position(|s| !fitting.take(s))?;
    let note = fitting.note(keep, stacks.len());
    stacks.truncate(keep);
    Some(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, address: u64) -> pb::Frame {
        pb::Frame {
            address,
            function: function.into(),
            offset: 4,
            module: "[kernel]".into(),
            ..Default::default()
        }
    }

    fn stack(roots: &[&str], kernel: &[pb::Frame], value: &str) -> pb::Stack {
        pb::Stack {
            roots: roots.iter().map(|r| r.to_string()).collect(),
            kernel: kernel.to_vec(),
            value: value.into(),
            ..Default::default()
        }
    }

    #[test]
    fn stacks_fold_as_flame_graphs_read_them() {
        let mut s = stack(
            &["sleep"],
            &[
                frame("entry_SYSCALL_64", 1),
                frame("schedule", 2),
                frame("", 0xffff_0010),
            ],
            "42",
        );
        s.user = vec![pb::Frame {
            address: 0x7f00,
            function: "clock_nanosleep".into(),
            ..Default::default()
        }];
        assert_eq!(
            folded_line(&s),
            "sleep;clock_nanosleep;entry_SYSCALL_64_[k];schedule_[k];0xffff0010_[k] 42"
        );
        s.user_lost = LostStack::Eexist as i32;
        s.user.clear();
        assert!(folded_line(&s).starts_with("sleep;[Missed User Stack];entry"));
        s.user_lost = LostStack::NoStack as i32;
        assert!(folded_line(&s).starts_with("sleep;entry_SYSCALL_64_[k]"));
    }

    #[test]
    fn stacks_that_name_the_same_frames_merge_exactly() {
        // The same frames at other addresses (another host's kernel).
        let a = stack(&["x"], &[frame("schedule", 1)], "18446744073709551615");
        let b = stack(&["x"], &[frame("schedule", 99)], "1");
        let c = stack(&["y"], &[frame("schedule", 1)], "5");
        let merged = merge([&a, &b, &c]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].value, "18446744073709551616");
        assert_eq!(merged[1].roots, ["y"]);
        // Unnamed frames merge by address only.
        let d = stack(&["x"], &[frame("", 1)], "1");
        let e = stack(&["x"], &[frame("", 2)], "1");
        assert_eq!(merge([&d, &e]).len(), 2);
    }

    #[test]
    fn an_answer_keeps_the_heaviest_stacks_that_fit_and_says_so() {
        let stack = |i: u64| pb::Stack {
            user: (0..20)
                .map(|f| pb::Frame {
                    address: 0x40_0000 + i * 64 + f,
                    function: format!("function_{f}"),
                    module: "/usr/bin/a-binary-with-a-long-path".into(),
                    ..Default::default()
                })
                .collect(),
            value: (10_000 - i).to_string(),
            ..Default::default()
        };
        let mut stacks: Vec<pb::Stack> = (0..10_000).map(stack).collect();
        let one = stacks[0].encoded_len();
        let budget = ANSWER_MARGIN + 100 * (one + 4);
        let note = fit(&mut stacks, budget).expect("over the limit");
        assert!((95..=100).contains(&stacks.len()), "{}", stacks.len());
        assert_eq!(stacks[0].value, "10000", "the heaviest first");
        assert!(
            note.starts_with(&format!(
                "the answer holds the heaviest {} of 10000 stacks",
                stacks.len()
            )),
            "{note}"
        );
        assert!(note.contains("limits.max_message_bytes"), "{note}");
        // Within the limit: all, and nothing said.
        let mut few: Vec<pb::Stack> = (0..10).map(stack).collect();
        assert_eq!(fit(&mut few, 64 << 20), None);
        assert_eq!(few.len(), 10);
    }
}
