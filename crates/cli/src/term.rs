//! Text from a sandbox (file names, values, variables, tags, error messages
//! that quote guest data) on the user's terminal, in forkbox's own lines:
//! control characters would be commands to the terminal (OSC 52 writes the
//! clipboard, OSC 0 the window title, CSI sequences erase and move), so each
//! is shown as an escape (`\x1b`, `\x07`, `\x9b`, `\u{202e}`). The program's
//! own stdout and stderr are not passed through this: they reach the terminal
//! as the program wrote them, as a terminal user expects.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` must not reach a terminal raw: C0 controls (ESC among them),
/// DEL, C1 controls (U+0080-U+009F: 8-bit CSI/OSC on some terminals), and
/// the bidirectional overrides and isolates that reorder what is shown.
fn unsafe_char(c: char, lines: bool) -> bool {
    if lines && (c == '\n' || c == '\t') {
        return false;
    }
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

fn escape_with(s: &str, lines: bool) -> Cow<'_, str> {
    if !s.chars().any(|c| unsafe_char(c, lines)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !unsafe_char(c, lines) {
            out.push(c);
        } else if (c as u32) < 0x100 {
            let _ = write!(out, "\\x{:02x}", c as u32);
        } else {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
    Cow::Owned(out)
}

/// `s` for one line of forkbox's output: every control character escaped (newlines too).
pub fn escape(s: &str) -> Cow<'_, str> {
    escape_with(s, false)
}

/// `s` for text that may span lines (a value's repr, pip's lines): as
/// [`escape`], but newlines and tabs stay.
pub fn escape_text(s: &str) -> Cow<'_, str> {
    escape_with(s, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(escape("plot.png"), "plot.png");
        assert_eq!(escape("x\x1b]52;c;aGk=\x07.txt"), "x\\x1b]52;c;aGk=\\x07.txt");
        assert_eq!(escape("a\nb\tc\r\x7f\u{9b}2K"), "a\\x0ab\\x09c\\x0d\\x7f\\x9b2K");
        assert_eq!(escape("\u{202e}gnp.exe"), "\\u{202e}gnp.exe");
        assert_eq!(escape("naïve 数据"), "naïve 数据");
        assert_eq!(escape_text("array([1,\n\t2])\x1b[2K"), "array([1,\n\t2])\\x1b[2K");
    }
}
