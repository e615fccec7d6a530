//! Connection strings with their secrets hidden, for errors and logs: what an operator may paste
//! into a ticket must never carry a database password.

/// `text` with every password replaced by `***`: the `user:password@` of a URL, a `password=`
/// query parameter (also percent-encoded as a key), and `password=` in a libpq key=value string.
/// Conservative where the shape is unclear: everything between the scheme's `user:` and the
/// last `@` before the query counts as the password, since an unencoded `/`, `?` or `#` in a
/// password would otherwise leave part of it visible.
pub fn connection_string(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return key_value_string(text);
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (before_query, query) = match before_query.rfind('@') {
        // The '@' of user information can only be followed by the host: a '?' before it is part
        // of the password, so the query starts after it.
        None if query.is_some_and(|q| q.contains('@')) => {
            let at = rest.rfind('@').unwrap_or(rest.len());
            let query_start = rest[at..].find('?').map(|i| at + i);
            match query_start {
                Some(q) => (&rest[..q], Some(&rest[q + 1..])),
                None => (rest, None),
            }
        }
        _ => (before_query, query),
    };
    let mut shown = format!("{scheme}://");
    match before_query.rfind('@') {
        Some(at) => match before_query[..at].split_once(':') {
            Some((user, _)) => {
                shown.push_str(user);
                shown.push_str(":***");
                shown.push_str(&before_query[at..]);
            }
            None => shown.push_str(before_query),
        },
        None => shown.push_str(before_query),
    }
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if is_password_key(key) => format!("{key}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        shown.push('?');
        shown.push_str(&pairs.join("&"));
    }
    shown
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
    let mut from = 0;
    while let Some(i) = text[from..].find("password") {
        let at = from + i;
        let starts_word = at == 0 || text[..at].ends_with(char::is_whitespace);
        let followed = text[at + "password".len()..].trim_start().starts_with('=');
        if starts_word && followed {
            return Some(at);
        }
        from = at + "password".len();
    }
    None
}

/// `password`, also percent-encoded.
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
    decoded.eq_ignore_ascii_case("password")
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
    }
}
