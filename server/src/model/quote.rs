//! Request text quoted in log lines and error messages.

/// Longest piece of a request quoted in a log line or an error message.
pub const MAX_QUOTE: usize = 64;

/// `s` as a quoted, escaped string of at most [`MAX_QUOTE`] characters
/// (followed by "..." when cut).
pub fn quote(s: &str) -> String {
    match s.char_indices().nth(MAX_QUOTE) {
        None => format!("{s:?}"),
        Some((at, _)) => format!("{:?}...", &s[..at]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_bounded_and_escaped() {
        assert_eq!(quote("demo/flows"), "\"demo/flows\"");
        assert_eq!(quote("a\nb"), "\"a\\nb\"");
        let long = "x".repeat(10_000);
        let q = quote(&long);
        assert_eq!(q.len(), MAX_QUOTE + 2 + 3);
        assert!(q.ends_with("\"..."));
        let wide = "é".repeat(100);
        assert!(quote(&wide).starts_with("\"éé"));
    }
}
