//! Bearer tokens of `--auth-tokens FILE`: a name and the SHA-256 of its secret per line.
//!
//! ```text
//! # name        sha256 of the secret, hex (printf %s "$SECRET" | sha256sum)
//! ci-runner     9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! ```
//!
//! A caller sends `authorization: Bearer <secret>` and becomes `token:<name>`. The file holds
//! only digests, so reading it does not reveal a secret. An unsalted SHA-256 is enough because
//! the secrets are random and long (at least 128 bits, e.g. `openssl rand -hex 32`): nobody can
//! search such a space, and a slow password hash would only cost CPU on every call. Human-chosen
//! passwords must not be used as tokens. The digest is compared with every entry in constant
//! time, so timing tells nothing about how close a guess came.

use std::path::Path;

use sha2::{Digest, Sha256};

/// Shortest secret accepted from a caller: 16 bytes of text; real secrets are longer.
const SECRET_MIN_BYTES: usize = 16;
/// Longest secret read from a caller.
const SECRET_MAX_BYTES: usize = 1024;

/// The tokens of the file: (name, SHA-256 of the secret).
#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<(String, [u8; 32])>,
}

/// Never prints digests.
impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} entries)", self.entries.len())
    }
}

impl Tokens {
    /// Reads and checks the file; the error names the file and the line.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--auth-tokens {}: {e}", path.display()))?;
        Tokens::parse(&text).map_err(|e| format!("--auth-tokens {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Tokens, String> {
        let mut entries: Vec<(String, [u8; 32])> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, hex] = fields.as_slice() else {
                return Err(format!(
                    "line {n}: expected \"NAME SHA256-HEX\", found {} fields",
                    fields.len()
                ));
            };
            super::policy::check_identity(&format!("token:{name}"))
                .map_err(|e| format!("line {n}: {e}"))?;
            let digest = parse_hex32(hex).ok_or_else(|| {
                format!(
                    "line {n}: the digest of {name:?} must be 64 hex digits (the SHA-256 of the \
                     secret), got {} characters",
                    hex.len()
                )
            })?;
            if entries.iter().any(|(other, _)| other == name) {
                return Err(format!("line {n}: token {name:?} is listed twice"));
            }
            if let Some((other, _)) = entries.iter().find(|(_, d)| *d == digest) {
                return Err(format!(
                    "line {n}: token {name:?} has the same secret as {other:?}; every token \
                     needs its own secret"
                ));
            }
            entries.push(((*name).to_owned(), digest));
        }
        Ok(Tokens { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The name of the token whose secret is `secret`, if any. Every entry is compared, in
    /// constant time, whatever matches.
    pub fn identify(&self, secret: &str) -> Option<&str> {
        if secret.len() < SECRET_MIN_BYTES || secret.len() > SECRET_MAX_BYTES {
            return None;
        }
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        let mut found = None;
        for (name, expected) in &self.entries {
            if bool::from(subtle::ConstantTimeEq::ct_eq(&expected[..], &digest[..])) {
                found = Some(name.as_str());
            }
        }
        found
    }
}

fn parse_hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SHA-256 hex of `secret`, as the tokens file wants it.
    fn digest_hex(secret: &str) -> String {
        Sha256::digest(secret.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn a_token_is_found_by_its_secret_only() {
        let secret = "0123456789abcdef0123456789abcdef";
        let text = format!(
            "# comment\n\nci {}\nother {}\n",
            digest_hex(secret),
            digest_hex("another secret of enough length")
        );
        let tokens = Tokens::parse(&text).unwrap();
        assert_eq!(tokens.identify(secret), Some("ci"));
        assert_eq!(tokens.identify("0123456789abcdef0123456789abcdeX"), None);
        assert_eq!(tokens.identify(""), None);
    }

    #[test]
    fn bad_files_name_the_line() {
        let d = digest_hex("0123456789abcdef0123456789abcdef");
        for (text, what) in [
            ("ci\n".to_owned(), "line 1"),
            (format!("ci {d} extra\n"), "3 fields"),
            ("ci abcd\n".to_owned(), "64 hex digits"),
            (format!("ci {d}\nci {d}\n"), "twice"),
            (format!("a {d}\nb {d}\n"), "same secret"),
        ] {
            let e = Tokens::parse(&text).unwrap_err();
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }
}
