//! Just enough SQL lexing to find statement boundaries and classify each statement by its leading
//! words: transaction control, session settings, `lockd.fence` settings, or data.
//!
//! It understands quoted strings (standard, `E''` escape strings), quoted identifiers, dollar
//! quoting, line and nested block comments, so a `;` or a keyword inside any of them is never
//! mistaken for syntax. It assumes `standard_conforming_strings = on` (the default since
//! Postgres 9.1).

use crate::limits::MAX_STATEMENTS_PER_QUERY;

/// Leading tokens kept per statement: enough for `SET SESSION lockd . fence TO 'x'` and
/// `ROLLBACK WORK TO SAVEPOINT`.
const LEADING_TOKENS: usize = 8;

/// A lexical token, as far as classification needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// An unquoted word, upper-cased.
    Word(String),
    /// A double-quoted identifier, as written inside the quotes.
    Ident(String),
    /// A string constant with its escapes resolved.
    Str(String),
    /// Any other single character (operators, punctuation, digits).
    Punct(char),
}

/// What a statement does to the transaction and to the fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Whitespace or comments only.
    Empty,
    /// `BEGIN`, `START TRANSACTION`: opens a block; the fence is recorded before the first data
    /// statement, so isolation options still apply.
    TxnStart,
    /// `SET TRANSACTION`, `SAVEPOINT`, `RELEASE`: must not be preceded by a query, touches no data.
    TxnControl,
    /// `COMMIT`, `END`, `ROLLBACK`, `ABORT`, `PREPARE TRANSACTION`: ends the transaction.
    TxnEnd,
    /// `ROLLBACK TO SAVEPOINT`: may undo the fence record, so the fence is recorded again.
    RollbackTo,
    /// `SET`, `SHOW`, `RESET`, `DISCARD`, `DEALLOCATE`, `LISTEN`, `UNLISTEN`, SQL `PREPARE`:
    /// session state only, no table data.
    Session,
    /// `SET [SESSION] lockd.fence = ...`, `RESET lockd.fence`, `SET lockd.fence TO DEFAULT`;
    /// `None` clears the fence. The value is unvalidated text.
    FenceSet(Option<String>),
    /// `RESET ALL` and `DISCARD ALL`: forwarded, and they clear the fence as they clear every
    /// setting.
    ResetAll,
    /// `SET LOCAL lockd.fence`: refused, because the proxy's fence is a session setting.
    FenceLocal,
    /// Everything else: may read or write table data.
    Data,
}

/// Splits a query string into statements and classifies each; empty statements are dropped.
/// Returns `None` when the string has more than [`MAX_STATEMENTS_PER_QUERY`] statements.
pub fn classify_query(sql: &str) -> Option<Vec<Kind>> {
    let mut kinds = Vec::new();
    let mut lexer = Lexer::new(sql);
    loop {
        let (tokens, more) = lexer.statement();
        let kind = classify(&tokens);
        if kind != Kind::Empty {
            if kinds.len() == MAX_STATEMENTS_PER_QUERY {
                return None;
            }
            kinds.push(kind);
        }
        if !more {
            return Some(kinds);
        }
    }
}

/// Classifies the first statement of `sql` (a Parse message holds exactly one).
pub fn classify_statement(sql: &str) -> Kind {
    let (tokens, _) = Lexer::new(sql).statement();
    classify(&tokens)
}

fn is_word(t: Option<&Token>, w: &str) -> bool {
    matches!(t, Some(Token::Word(x)) if x == w)
}

/// Whether `tokens[i..]` names `lockd.fence` and, if so, how many tokens that took.
fn fence_name_at(tokens: &[Token], i: usize) -> Option<usize> {
    match (tokens.get(i), tokens.get(i + 1), tokens.get(i + 2)) {
        (Some(Token::Word(a)), Some(Token::Punct('.')), Some(Token::Word(b)))
            if a == "LOCKD" && b == "FENCE" =>
        {
            Some(3)
        }
        (Some(Token::Ident(a)), _, _) if a == "lockd.fence" => Some(1),
        _ => None,
    }
}

fn classify(tokens: &[Token]) -> Kind {
    let Some(Token::Word(first)) = tokens.first() else {
        return if tokens.is_empty() {
            Kind::Empty
        } else {
            Kind::Data
        };
    };
    let second = tokens.get(1);
    match first.as_str() {
        "BEGIN" => Kind::TxnStart,
        "START" if is_word(second, "TRANSACTION") => Kind::TxnStart,
        "SAVEPOINT" | "RELEASE" => Kind::TxnControl,
        "COMMIT" | "ROLLBACK" if is_word(second, "PREPARED") => Kind::Data,
        "ROLLBACK" | "ABORT"
            if tokens
                .iter()
                .take(3)
                .skip(1)
                .any(|t| matches!(t, Token::Word(w) if w == "TO")) =>
        {
            Kind::RollbackTo
        }
        "COMMIT" | "END" | "ROLLBACK" | "ABORT" => Kind::TxnEnd,
        "PREPARE" if is_word(second, "TRANSACTION") => Kind::TxnEnd,
        "SET" => classify_set(tokens),
        "RESET" => {
            if fence_name_at(tokens, 1).is_some() {
                Kind::FenceSet(None)
            } else if is_word(second, "ALL") {
                Kind::ResetAll
            } else {
                Kind::Session
            }
        }
        "DISCARD" if is_word(second, "ALL") => Kind::ResetAll,
        "SHOW" | "DISCARD" | "DEALLOCATE" | "LISTEN" | "UNLISTEN" => Kind::Session,
        "PREPARE" => Kind::Session,
        _ => Kind::Data,
    }
}

fn classify_set(tokens: &[Token]) -> Kind {
    let mut i = 1;
    let mut local = false;
    match tokens.get(1) {
        Some(Token::Word(w)) if w == "SESSION" => {
            if is_word(tokens.get(2), "CHARACTERISTICS") {
                return Kind::Session;
            }
            i = 2;
        }
        Some(Token::Word(w)) if w == "LOCAL" => {
            local = true;
            i = 2;
        }
        Some(Token::Word(w)) if w == "TRANSACTION" => return Kind::TxnControl,
        _ => {}
    }
    let Some(n) = fence_name_at(tokens, i) else {
        return Kind::Session;
    };
    if local {
        return Kind::FenceLocal;
    }
    i += n;
    match tokens.get(i) {
        Some(Token::Word(w)) if w == "TO" => i += 1,
        Some(Token::Punct('=')) => i += 1,
        // Anything else is a syntax error; hand Postgres-like feedback through the fence parser.
        _ => return Kind::FenceSet(Some(String::new())),
    }
    let value = match tokens.get(i) {
        Some(Token::Word(w)) if w == "DEFAULT" => return Kind::FenceSet(None),
        Some(Token::Str(s)) | Some(Token::Ident(s)) => s.clone(),
        Some(Token::Word(w)) => w.to_lowercase(),
        _ => String::new(),
    };
    // `SET x = 'a', 'b'` (a list) or trailing tokens are not a single fence value.
    if tokens.len() > i + 1 {
        return Kind::FenceSet(Some(String::new()));
    }
    Kind::FenceSet(Some(value))
}

struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::CharIndices<'a>>,
    src: &'a str,
}

impl<'a> Lexer<'a> {
    fn new(src: &'a str) -> Self {
        Lexer {
            chars: src.char_indices().peekable(),
            src,
        }
    }

    /// Lexes up to the next top-level `;`. Returns the first [`LEADING_TOKENS`] tokens and whether
    /// anything follows the `;`.
    fn statement(&mut self) -> (Vec<Token>, bool) {
        let mut tokens = Vec::new();
        let push = |tokens: &mut Vec<Token>, t: Token| {
            if tokens.len() < LEADING_TOKENS {
                tokens.push(t);
            }
        };
        while let Some((pos, c)) = self.chars.next() {
            match c {
                ';' => return (tokens, self.chars.peek().is_some()),
                c if c.is_whitespace() => {}
                '-' if self.peek_is('-') => {
                    for (_, c) in self.chars.by_ref() {
                        if c == '\n' {
                            break;
                        }
                    }
                }
                '/' if self.peek_is('*') => {
                    self.chars.next();
                    self.block_comment();
                }
                '\'' => {
                    let s = self.string(false);
                    push(&mut tokens, Token::Str(s));
                }
                '"' => {
                    let s = self.quoted_ident();
                    push(&mut tokens, Token::Ident(s));
                }
                '$' if self.dollar_quote(pos) => {
                    push(&mut tokens, Token::Str(String::new()));
                }
                c if c.is_alphabetic() || c == '_' => {
                    let mut word = String::from(c);
                    while let Some(&(_, n)) = self.chars.peek() {
                        if n.is_alphanumeric() || n == '_' || n == '$' {
                            word.push(n);
                            self.chars.next();
                        } else {
                            break;
                        }
                    }
                    let upper = word.to_uppercase();
                    if (upper == "E") && self.peek_is('\'') {
                        self.chars.next();
                        let s = self.string(true);
                        push(&mut tokens, Token::Str(s));
                    } else if matches!(upper.as_str(), "U" | "B" | "X" | "N") && self.peek_is('\'')
                    {
                        self.chars.next();
                        let s = self.string(false);
                        push(&mut tokens, Token::Str(s));
                    } else {
                        push(&mut tokens, Token::Word(upper));
                    }
                }
                c => push(&mut tokens, Token::Punct(c)),
            }
        }
        (tokens, false)
    }

    fn peek_is(&mut self, c: char) -> bool {
        matches!(self.chars.peek(), Some(&(_, n)) if n == c)
    }

    fn block_comment(&mut self) {
        let mut depth = 1usize;
        while let Some((_, c)) = self.chars.next() {
            if c == '*' && self.peek_is('/') {
                self.chars.next();
                depth -= 1;
                if depth == 0 {
                    return;
                }
            } else if c == '/' && self.peek_is('*') {
                self.chars.next();
                depth += 1;
            }
        }
    }

    /// Reads a string body after the opening quote; `''` is a quote, and with `escapes` a
    /// backslash takes the next character literally (enough for `\\` and `\'`).
    fn string(&mut self, escapes: bool) -> String {
        let mut out = String::new();
        while let Some((_, c)) = self.chars.next() {
            match c {
                '\\' if escapes => {
                    if let Some((_, n)) = self.chars.next() {
                        out.push(n);
                    }
                }
                '\'' if self.peek_is('\'') => {
                    self.chars.next();
                    out.push('\'');
                }
                '\'' => return out,
                c => out.push(c),
            }
        }
        out
    }

    fn quoted_ident(&mut self) -> String {
        let mut out = String::new();
        while let Some((_, c)) = self.chars.next() {
            match c {
                '"' if self.peek_is('"') => {
                    self.chars.next();
                    out.push('"');
                }
                '"' => return out,
                c => out.push(c),
            }
        }
        out
    }

    /// At a `$` (byte offset `pos`): if it opens a dollar-quoted string (`$$` or `$tag$`), skips
    /// the whole string and returns true; a positional parameter like `$1` returns false.
    fn dollar_quote(&mut self, pos: usize) -> bool {
        let rest = &self.src[pos + 1..];
        let tag_len = rest
            .char_indices()
            .find(|&(i, c)| !(c.is_alphabetic() || c == '_' || (i > 0 && c.is_ascii_digit())))
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        if !rest[tag_len..].starts_with('$') {
            return false;
        }
        let delimiter = &self.src[pos..pos + tag_len + 2];
        let body_start = pos + tag_len + 2;
        let end = self.src[body_start..]
            .find(delimiter)
            .map(|i| body_start + i + delimiter.len())
            .unwrap_or(self.src.len());
        while matches!(self.chars.peek(), Some(&(i, _)) if i < end) {
            self.chars.next();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_classifies_statements() {
        let kinds =
            classify_query("BEGIN; insert into t values (';'); -- c;\n /* a /* ; */ */ COMMIT; ;")
                .unwrap();
        assert_eq!(kinds, vec![Kind::TxnStart, Kind::Data, Kind::TxnEnd]);
        assert_eq!(
            classify_query("select $x$ ; commit $x$; select $1").unwrap(),
            vec![Kind::Data, Kind::Data]
        );
        assert_eq!(
            classify_query("rollback to savepoint a; release a; savepoint b").unwrap(),
            vec![Kind::RollbackTo, Kind::TxnControl, Kind::TxnControl]
        );
        assert_eq!(classify_statement("  "), Kind::Empty);
        assert_eq!(classify_statement("commit prepared 'x'"), Kind::Data);
        assert_eq!(
            classify_statement("SET TRANSACTION READ ONLY"),
            Kind::TxnControl
        );
        assert_eq!(classify_statement("set search_path = x"), Kind::Session);
    }

    #[test]
    fn recognises_every_spelling_of_the_fence_setting() {
        let set = |v: &str| Kind::FenceSet(Some(v.to_owned()));
        assert_eq!(
            classify_statement("SET lockd.fence = 'orders:42'"),
            set("orders:42")
        );
        assert_eq!(
            classify_statement("set session LOCKD.FENCE to 'a:b:7'"),
            set("a:b:7")
        );
        assert_eq!(
            classify_statement("SET \"lockd.fence\" = E'it\\'s:1'"),
            set("it's:1")
        );
        assert_eq!(
            classify_statement("SET lockd.fence = 'o''k:3';"),
            set("o'k:3")
        );
        assert_eq!(
            classify_statement("RESET lockd.fence"),
            Kind::FenceSet(None)
        );
        assert_eq!(
            classify_statement("SET lockd.fence TO DEFAULT"),
            Kind::FenceSet(None)
        );
        assert_eq!(
            classify_statement("SET LOCAL lockd.fence = 'a:1'"),
            Kind::FenceLocal
        );
        assert_eq!(
            classify_statement("SET lockd.fence = 'a:1', 'b:2'"),
            set("")
        );
        assert_eq!(classify_statement("RESET ALL"), Kind::ResetAll);
        assert_eq!(
            classify_statement("select 'SET lockd.fence = 1'"),
            Kind::Data
        );
    }
}
