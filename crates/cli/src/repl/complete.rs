//! Is this REPL input a complete statement, or does it continue on the next line?
//!
//! The same decision CPython's interactive prompt makes (`code.compile_command`),
//! from a small tokenizer instead of a compiler: input continues while a bracket
//! or a triple-quoted string is open or the last line ends in a backslash; once
//! the input is a compound statement (a logical line ends with `:`, starts with
//! a block keyword, or is a decorator) it continues until a blank line. Anything
//! else is complete, including input Python will reject: the guest reports the
//! SyntaxError.

/// Keywords that start a compound statement (its block follows, even on the same line: `if x: f()`).
const BLOCK_KEYWORDS: &[&str] =
    &["if", "elif", "else", "for", "while", "try", "except", "finally", "with", "def", "class", "async"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Send it.
    Complete,
    /// Ask for another line.
    Incomplete,
}

/// Tokenizer state between characters.
#[derive(Clone, Copy, PartialEq)]
enum Str {
    None,
    /// In a string: the quote character and whether it is triple-quoted.
    In(char, bool),
}

pub fn check(src: &str) -> Input {
    if src.trim().is_empty() {
        return Input::Complete;
    }
    let chars: Vec<char> = src.chars().collect();
    let mut depth: usize = 0;
    let mut string = Str::None;
    let mut compound = false;
    // The logical line being scanned: its first word / first significant char and its last significant char.
    let mut line_start = true;
    let mut first_word = String::new();
    let mut in_first_word = false;
    let mut last_sig: Option<char> = None;
    let mut continued = false; // the last physical line ended with a backslash
    let mut i = 0;
    let end_logical = |last_sig: &mut Option<char>, first_word: &mut String, compound: &mut bool| {
        if *last_sig == Some(':') || BLOCK_KEYWORDS.contains(&first_word.as_str()) {
            *compound = true;
        }
        *last_sig = None;
        first_word.clear();
    };
    while i < chars.len() {
        let c = chars[i];
        continued = false;
        match string {
            Str::In(q, triple) => {
                if c == '\\' {
                    // The escaped character never ends the string; at the very end, the line continues.
                    continued = i + 1 == chars.len();
                    i += 2;
                    continue;
                }
                if triple && c == q && chars.get(i + 1) == Some(&q) && chars.get(i + 2) == Some(&q) {
                    string = Str::None;
                    last_sig = Some(q);
                    i += 3;
                    continue;
                }
                if !triple && c == q {
                    string = Str::None;
                    last_sig = Some(q);
                } else if !triple && c == '\n' {
                    // An unterminated single-quoted string: a SyntaxError, the line is over.
                    string = Str::None;
                    if depth == 0 {
                        end_logical(&mut last_sig, &mut first_word, &mut compound);
                        line_start = true;
                    }
                }
                i += 1;
                continue;
            }
            Str::None => {}
        }
        if in_first_word && !(c.is_alphanumeric() || c == '_') {
            in_first_word = false;
        }
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '\\' if chars.get(i + 1) == Some(&'\n') || i + 1 == chars.len() => {
                continued = true;
                i += 2;
                continue;
            }
            '\n' => {
                if depth == 0 {
                    end_logical(&mut last_sig, &mut first_word, &mut compound);
                    line_start = true;
                }
                i += 1;
                continue;
            }
            ' ' | '\t' | '\r' | '\x0c' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        if line_start {
            line_start = false;
            if c == '@' && depth == 0 {
                compound = true;
            }
            if c.is_alphabetic() || c == '_' {
                in_first_word = true;
            }
        }
        if in_first_word {
            first_word.push(c);
        }
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            '\'' | '"' => {
                let triple = chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c);
                string = Str::In(c, triple);
                i += if triple { 3 } else { 1 };
                last_sig = Some(c);
                continue;
            }
            _ => {}
        }
        last_sig = Some(c);
        i += 1;
    }
    if matches!(string, Str::In(_, true)) || depth > 0 || continued {
        return Input::Incomplete;
    }
    end_logical(&mut last_sig, &mut first_word, &mut compound);
    // A compound statement ends with a blank line.
    if compound && !src.rsplit_once('\n').is_some_and(|(_, last)| last.trim().is_empty()) {
        return Input::Incomplete;
    }
    Input::Complete
}

#[cfg(test)]
mod tests {
    use super::*;
    use Input::*;

    /// The REPL's input so far: the lines entered, each ended by Enter.
    fn lines(ls: &[&str]) -> Input {
        check(&ls.join("\n"))
    }

    #[test]
    fn simple_statements_are_complete() {
        for s in [
            "x = 1",
            "print('a:')",
            "f(x)[0]",
            "d = {1: 2}",
            "a[1:]",
            "lambda: 0",
            "import os",
            "x  # comment:",
            "'''one line'''",
            "r'\\d+'",
            "b'\\''",
        ] {
            assert_eq!(check(s), Complete, "{s:?}");
        }
    }

    #[test]
    fn open_brackets_continue() {
        assert_eq!(lines(&["f(1,"]), Incomplete);
        assert_eq!(lines(&["x = [", "  1, 2,"]), Incomplete);
        assert_eq!(lines(&["x = [", "  1, 2,", "]"]), Complete);
        assert_eq!(lines(&["d = {'a': (1,", "  2)}"]), Complete);
        // A blank line does not end an open bracket.
        assert_eq!(lines(&["f(", ""]), Incomplete);
        // Brackets inside strings and comments do not count.
        assert_eq!(check("s = '('"), Complete);
        assert_eq!(check("x = 1  # ("), Complete);
        assert_eq!(check("s = \"[\" + ']'"), Complete);
    }

    #[test]
    fn triple_quoted_strings_continue_until_closed() {
        assert_eq!(lines(&["s = '''abc"]), Incomplete);
        assert_eq!(lines(&["s = '''abc", "", "def ( :"]), Incomplete);
        assert_eq!(lines(&["s = '''abc", "def'''"]), Complete);
        assert_eq!(lines(&["s = \"\"\"a", "b \\\"\"\" still", "c\"\"\""]), Complete);
        assert_eq!(lines(&["s = \"\"\"a", "b '''", "c"]), Incomplete);
    }

    #[test]
    fn backslash_continues_a_line() {
        assert_eq!(check("x = 1 + \\"), Incomplete);
        assert_eq!(lines(&["x = 1 + \\", "2"]), Complete);
        assert_eq!(check("s = 'abc\\"), Incomplete);
        assert_eq!(lines(&["s = 'abc\\", "def'"]), Complete);
        // A backslash in a comment is just text.
        assert_eq!(check("x = 1  # \\"), Complete);
    }

    #[test]
    fn compound_statements_end_with_a_blank_line() {
        assert_eq!(lines(&["def f(x):"]), Incomplete);
        assert_eq!(lines(&["def f(x):", "    return x + 1"]), Incomplete);
        assert_eq!(lines(&["def f(x):", "    return x + 1", ""]), Complete);
        assert_eq!(
            lines(&["for i in range(3):", "    if i:", "        print(i)", "    else:", "        pass"]),
            Incomplete
        );
        assert_eq!(
            lines(&["for i in range(3):", "    if i:", "        print(i)", "    else:", "        pass", ""]),
            Complete
        );
        assert_eq!(lines(&["class A:", "    x = 1", "", ""]), Complete);
        // Like CPython's prompt, a one-line compound statement still waits for the blank line.
        assert_eq!(check("if True: print(1)"), Incomplete);
        assert_eq!(lines(&["if True: print(1)", ""]), Complete);
        assert_eq!(lines(&["while True: pass"]), Incomplete);
        assert_eq!(lines(&["@decorator"]), Incomplete);
        assert_eq!(lines(&["@decorator", "def f(): pass", ""]), Complete);
        assert_eq!(lines(&["match cmd:", "    case 1:", "        pass", ""]), Complete);
        assert_eq!(lines(&["match cmd:"]), Incomplete);
        // A colon at the end of a comment or inside brackets does not open a block.
        assert_eq!(check("x = 1  # note:"), Complete);
        assert_eq!(lines(&["try:  # guarded", "    f()", "except Exception:", "    pass"]), Incomplete);
        // Names that merely start with a keyword are not block keywords.
        assert_eq!(check("iffy = 1"), Complete);
        assert_eq!(check("format = 'x'"), Complete);
        assert_eq!(check("match = 3"), Complete);
        // A colon ending a line inside brackets is a dict or a slice.
        assert_eq!(lines(&["d = {1:", "  2}"]), Complete);
    }

    #[test]
    fn blank_input_and_syntax_errors_are_complete() {
        assert_eq!(check(""), Complete);
        assert_eq!(check("   "), Complete);
        assert_eq!(check("x = )"), Complete);
        assert_eq!(check("s = 'unterminated"), Complete);
    }
}
