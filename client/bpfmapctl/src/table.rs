//! Tables for people: aligned columns, every cell safe on a terminal.
//!
//! A table measures its first rows (up to [`MEASURED`], which is all of a
//! short answer) before it writes any, so that its columns fit them. A
//! later row wider than a column widens it: the header is written again
//! with the new widths, so that a reader sees where the columns moved.

use std::{borrow::Cow, fmt::Write as _, io};

/// Rows measured before the first is written: about a screenful.
pub(crate) const MEASURED: usize = 100;

/// `text` as a terminal may show it: every control character (C0, DEL,
/// C1: escape sequences among them) as `\xNN`, by its UTF-8 bytes.
pub(crate) fn safe(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            for b in c.encode_utf8(&mut [0; 4]).bytes() {
                let _ = write!(out, "\\x{b:02x}");
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A table being written.
#[derive(Debug)]
pub(crate) struct Table {
    header: Vec<String>,
    widths: Vec<usize>,
    /// Rows measured, not written yet.
    pending: Vec<Vec<String>>,
    /// Whether the header (and the measured rows) went out.
    started: bool,
}

impl Table {
    /// A table of these columns.
    pub(crate) fn new(header: Vec<String>) -> Self {
        let widths = header.iter().map(|h| width(h)).collect();
        Self {
            header,
            widths,
            pending: Vec::new(),
            started: false,
        }
    }

    /// Its columns.
    pub(crate) fn header(&self) -> &[String] {
        &self.header
    }

    /// Adds a row (its cells made safe): measured with the first rows, or
    /// written (the header again first when it widens a column).
    pub(crate) fn row(&mut self, out: &mut dyn io::Write, cells: &[String]) -> io::Result<()> {
        let cells: Vec<String> = cells.iter().map(|c| safe(c).into_owned()).collect();
        if self.widths.len() < cells.len() {
            self.widths.resize(cells.len(), 0);
        }
        let wider = cells.iter().zip(&self.widths).any(|(c, w)| width(c) > *w);
        for (w, c) in self.widths.iter_mut().zip(&cells) {
            *w = (*w).max(width(c));
        }
        if !self.started {
            self.pending.push(cells);
            if self.pending.len() >= MEASURED {
                self.start(out)?;
            }
            return Ok(());
        }
        if wider {
            self.line(out, &self.header.clone())?;
        }
        self.line(out, &cells)
    }

    /// Writes what is left (the header and the measured rows of a short
    /// answer; nothing for a table without rows).
    pub(crate) fn finish(&mut self, out: &mut dyn io::Write) -> io::Result<()> {
        if !self.started && !self.pending.is_empty() {
            self.start(out)?;
        }
        Ok(())
    }

    fn start(&mut self, out: &mut dyn io::Write) -> io::Result<()> {
        self.started = true;
        self.line(out, &self.header.clone())?;
        for row in std::mem::take(&mut self.pending) {
            self.line(out, &row)?;
        }
        Ok(())
    }

    fn line(&self, out: &mut dyn io::Write, cells: &[String]) -> io::Result<()> {
        let mut line = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(c);
            let w = self.widths.get(i).copied().unwrap_or(0);
            line.extend(std::iter::repeat_n(' ', w.saturating_sub(width(c))));
        }
        writeln!(out, "{}", line.trim_end())
    }
}

/// The columns a cell takes: its characters.
fn width(text: &str) -> usize {
    text.chars().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(out: Vec<u8>) -> String {
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn columns_fit_every_row_of_a_short_answer() {
        let mut out = Vec::new();
        let mut t = Table::new(vec!["COMM".into(), "N".into()]);
        t.row(&mut out, &["kdamond.0".into(), "73".into()]).unwrap();
        t.row(&mut out, &["memfd:sealed-91".into(), "338".into()])
            .unwrap();
        assert!(out.is_empty(), "measured before written");
        t.finish(&mut out).unwrap();
        assert_eq!(
            text(out),
            "COMM             N\nkdamond.0        73\nmemfd:sealed-91  338\n"
        );
    }

    #[test]
    fn a_wider_row_after_the_measured_ones_widens_its_column_and_says_so() {
        let mut out = Vec::new();
        let mut t = Table::new(vec!["K".into(), "V".into()]);
        for i in 0..MEASURED {
            t.row(&mut out, &[format!("{}", i % 10), "v".into()])
                .unwrap();
        }
        t.row(&mut out, &["wide key".into(), "v".into()]).unwrap();
        t.row(&mut out, &["1".into(), "v".into()]).unwrap();
        t.finish(&mut out).unwrap();
        let lines: Vec<String> = text(out).lines().map(str::to_owned).collect();
        assert_eq!(lines[0], "K  V");
        assert_eq!(lines[1], "0  v");
        assert_eq!(lines[MEASURED + 1], "K         V", "the header again");
        assert_eq!(lines[MEASURED + 2], "wide key  v");
        assert_eq!(lines[MEASURED + 3], "1         v");
    }

    #[test]
    fn no_control_character_reaches_a_terminal() {
        assert_eq!(safe("bash"), "bash");
        assert_eq!(safe("\x1b[31mEVIL\x1b[0m"), "\\x1b[31mEVIL\\x1b[0m");
        assert_eq!(safe("a\u{9b}2J\nb\u{7f}"), "a\\xc2\\x9b2J\\x0ab\\x7f");
        let mut out = Vec::new();
        let mut t = Table::new(vec!["NAME".into()]);
        t.row(&mut out, &["\x1b]0;owned\x07".into()]).unwrap();
        t.finish(&mut out).unwrap();
        assert!(!text(out).contains('\x1b'));
    }
}
