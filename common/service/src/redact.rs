//! Connection strings with their secrets hidden, for errors and logs: what an operator may paste
//! into a ticket must never carry a database password.

/// `text` with every password replaced by `***`: the `user:password@` of a URL, a `password=`
/// query parameter (also percent-encoded as a key), and `password=` in a libpq key=value string.
/// Conservative where the shape is unclear: everything between the scheme's `user:` and the
/// last `@` before the query counts as the password, since an unencoded `/`, `?` or `#` in a
/// password would otherwise leave part of it visible.
pub fn connection_string(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://").filter(|(s, _)| is_scheme(s)) else {
        return key_value_string(text);
    };
    let query_at = rest.find('?').unwrap_or(rest.len());
    // User information ends at the last '@' before the query; a '?' inside a password ends the
    // part before the query too early, and shows as an '@' after it with no parameter between.
    let user_info_end = rest[..query_at].rfind('@').or_else(|| {
        let after = &rest[query_at..];
        let at = after.find('@')?;
        (!after[..at].contains(['&', '='])).then_some(query_at + at)
    });
    let mut shown = format!("{scheme}://");
    match user_info_end {
        Some(at) => {
            match rest[..at].split_once(':') {
                Some((user, _)) => {
                    shown.push_str(user);
                    shown.push_str(":***");
                }
                None => shown.push_str(&rest[..at]),
            }
            shown.push_str(&rest[at..]);
        }
        None => shown.push_str(rest),
    }
    hide_password_parameters(&shown)
}

/// Whether `s` is a URL scheme (`postgres`, `postgresql`, `https`): a letter, then letters,
/// digits, `+`, `-` or `.`.
fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// `url` with the value of every `password` or `sslpassword` parameter (the key also
/// percent-encoded) after a `?` or `&` replaced by `***`, up to the next `&`.
fn hide_password_parameters(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    while let Some(i) = rest.find(['?', '&']) {
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
        let pair_end = rest.find('&').unwrap_or(rest.len());
        match rest[..pair_end].split_once('=') {
            Some((key, _)) if is_password_key(key) => {
                out.push_str(key);
                out.push_str("=***");
                rest = &rest[pair_end..];
            }
            _ => {}
        }
    }
    out.push_str(rest);
    out
}

/// A libpq `key=value key='value'` string with the value of `password` hidden (anything else
/// without a scheme passes through unchanged).
fn key_value_string(text: &str) -> String {
    let Some(start) = find_password_key(text) else {
        return text.to_owned();
    };
    let after_key = &text[start..];
    let eq = after_key.find('=').map_or(after_key.len(), |i| i + 1);
    let value = after_key[eq..].trim_start();
    let skipped = after_key.len() - eq - value.len();
    // A quoted value runs to the closing quote (with `\'` escapes), a plain one to a space.
    let value_len = if let Some(quoted) = value.strip_prefix('\'') {
        let mut escaped = false;
        quoted
            .char_indices()
            .find(|&(_, c)| {
                let end = c == '\'' && !escaped;
                escaped = c == '\\' && !escaped;
                end
            })
            .map_or(value.len(), |(i, _)| i + 2)
    } else {
        value.find(char::is_whitespace).unwrap_or(value.len())
    };
    let rest_start = start + eq + skipped + value_len;
    format!(
        "{}***{}",
        &text[..start + eq + skipped],
        key_value_string(&text[rest_start..])
    )
}

/// Where a `password =` key starts in a key=value string.
fn find_password_key(text: &str) -> Option<usize> {
    let word_starts_at = |at: usize| at == 0 || text[..at].ends_with(char::is_whitespace);
    let mut from = 0;
    while let Some(i) = text[from..].find("password") {
        let at = from + i;
        let followed = text[at + "password".len()..].trim_start().starts_with('=');
        // `password`, or `sslpassword` (the client key's passphrase).
        let start = if word_starts_at(at) {
            Some(at)
        } else {
            at.checked_sub(3)
                .filter(|&s| text.get(s..at) == Some("ssl") && word_starts_at(s))
        };
        if let (Some(start), true) = (start, followed) {
            return Some(start);
        }
        from = at + "password".len();
    }
    None
}

/// `password` or `sslpassword`, also percent-encoded.
fn is_password_key(key: &str) -> bool {
    let mut decoded = String::new();
    let bytes = key.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = key
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            decoded.push(char::from(b));
            i += 3;
            continue;
        }
        decoded.push(char::from(bytes[i]));
        i += 1;
    }
    decoded.eq_ignore_ascii_case("password") || decoded.eq_ignore_ascii_case("sslpassword")
}

#[cfg(test)]
mod tests {
    use super::connection_string as r;

    #[test]
    fn passwords_are_hidden_wherever_they_are() {
        assert_eq!(r("postgres://app:pw@h:5/d"), "postgres://app:***@h:5/d");
        assert_eq!(
            r("postgres://app@h/d?sslmode=require&password=pw"),
            "postgres://app@h/d?sslmode=require&password=***"
        );
        assert_eq!(
            r("postgres://app@h/d?pass%77ord=pw"),
            "postgres://app@h/d?pass%77ord=***"
        );
        // Unencoded '/', '?' and '#' in the password.
        for url in [
            "postgres://app:pa/ss@h/d",
            "postgres://app:pa?ss@h/d",
            "postgres://app:pa#ss@h/d?sslmode=disable",
        ] {
            let shown = r(url);
            assert!(
                !shown.contains("ss@") && !shown.contains("pa"),
                "{url}: {shown}"
            );
            assert!(shown.starts_with("postgres://app:***@h"), "{url}: {shown}");
        }
        assert_eq!(r("postgres://app@h/d"), "postgres://app@h/d");
        // An '@' in a query value is not user information; the password after it is hidden.
        for url in [
            "postgres://db:5432/app?user=svc@corp&password=s3cret",
            "postgres://db/app?user=svc@corp&password=s3cret",
            "postgres://db/app?sslpassword=s3cret&user=a@b",
        ] {
            let shown = r(url);
            assert!(!shown.contains("s3cret"), "{url}: {shown}");
            assert!(shown.starts_with("postgres://db"), "{url}: {shown}");
        }
        // Not a URL though it holds "://": a key=value string.
        assert_eq!(
            r("host=db options='x://y' password=s3cret"),
            "host=db options='x://y' password=***"
        );
        assert_eq!(r("redb:/var/lib/e.redb"), "redb:/var/lib/e.redb");
        // libpq key=value strings.
        assert_eq!(
            r("host=db password=s3cret user=app"),
            "host=db password=*** user=app"
        );
        assert_eq!(
            r("host=db password = 's3 cr\\'et' user=app"),
            "host=db password = *** user=app"
        );
        assert_eq!(
            r("password=a passwordx=b password=c"),
            "password=*** passwordx=b password=***"
        );
        assert_eq!(r("host=h sslpassword=k"), "host=h sslpassword=***");
    }
}
