//! `--bind-resource`: a write's `Lock-Resource` must name what its request path writes.
//!
//! Without it the resource is only the request's label: a client that holds a lock on any
//! resource could fence a write to another path with it (and a sequencer authenticates the
//! label, not the path). With it the proxy compares the label with the path, and refuses every
//! path that an upstream could read as another one (percent-encoding, dot segments, empty
//! segments, `;` parameters, backslashes) rather than guess how the upstream reads it.

use std::fmt;

/// How a write's `Lock-Resource` must relate to its request path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ResourceBinding {
    /// Not checked: any path may be written under any resource the client holds.
    #[default]
    Off,
    /// The path without its leading `/` is the resource: `PUT /orders/42` needs `orders/42`.
    Path,
    /// The resource is the path or a part of it that ends at a `/`: `orders/42` covers
    /// `/orders/42` and `/orders/42/items/7`, not `/orders/421`. Resources must then not nest
    /// (holders of `orders` and of `orders/42` would both write `/orders/42/...`).
    PathPrefix,
}

impl fmt::Display for ResourceBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResourceBinding::Off => "off",
            ResourceBinding::Path => "path",
            ResourceBinding::PathPrefix => "path-prefix",
        })
    }
}

impl ResourceBinding {
    /// Checks that a write of `path` (the request's path as the client sent it, without the
    /// query) may be fenced by `resource`. The error says why not, naming both.
    pub fn check(self, resource: &str, path: &str) -> Result<(), String> {
        if self == ResourceBinding::Off {
            return Ok(());
        }
        let refuse = |why: &str| {
            Err(format!(
                "path {path:?} {why} (--bind-resource {self}, {}: {resource:?})",
                lockd_fence::LOCK_RESOURCE_HEADER
            ))
        };
        let Some(rest) = path.strip_prefix('/') else {
            return refuse("does not start with '/'");
        };
        // Only characters with one reading everywhere pass (an allow-list: a deny-list misses
        // the next alias). Each refused one lets a path name another object at some upstream:
        // decoded `%2F` or `%2e%2e`, a `;` parameter some servers drop (`/a;x` = `/a`), `\` as
        // a separator, non-ASCII text that an upstream normalises (`４２` = `42`).
        if let Some(c) = rest.chars().find(|c| !path_char(*c)) {
            return refuse(&format!(
                "holds {c:?}, which upstreams read differently; only ASCII letters, digits, '/' \
                 and -._~!$&'()*+,=:@ are accepted, the rest is refused rather than guessed"
            ));
        }
        // Empty, `.` and `..` segments are resolved away; a trailing `.` is dropped by Windows
        // servers (`/a/42.` = `/a/42`).
        if let Some(segment) = rest.split('/').find(|s| s.is_empty() || s.ends_with('.')) {
            return refuse(&format!(
                "has an empty segment or one ending in '.' ({segment:?}), which upstreams \
                 resolve differently"
            ));
        }
        let covered = match self {
            ResourceBinding::Off => true,
            ResourceBinding::Path => rest == resource,
            ResourceBinding::PathPrefix => {
                rest == resource
                    || rest
                        .strip_prefix(resource)
                        .is_some_and(|tail| tail.starts_with('/'))
            }
        };
        if covered {
            Ok(())
        } else {
            refuse(match self {
                ResourceBinding::PathPrefix => "is not the resource or below it",
                _ => "is not the resource",
            })
        }
    }
}

/// Characters a bound path may hold besides `/`: RFC 3986's unreserved characters, its
/// sub-delimiters but `;`, and `:` and `@`.
fn path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "/-._~!$&'()*+,=:@".contains(c)
}

#[cfg(test)]
mod tests {
    use super::ResourceBinding::{self, Off, Path, PathPrefix};

    fn ok(b: ResourceBinding, resource: &str, path: &str) -> bool {
        b.check(resource, path).is_ok()
    }

    #[test]
    fn exact_and_prefix_binding() {
        assert!(ok(Path, "orders/42", "/orders/42"));
        assert!(!ok(Path, "orders/42", "/orders/43"));
        assert!(!ok(Path, "orders/42", "/orders/42/items"));
        assert!(!ok(Path, "orders/42", "/Orders/42"));
        assert!(ok(PathPrefix, "orders/42", "/orders/42"));
        assert!(ok(PathPrefix, "orders/42", "/orders/42/items/7"));
        assert!(!ok(PathPrefix, "orders/42", "/orders/421"));
        assert!(!ok(PathPrefix, "orders/42", "/orders"));
        assert!(ok(Off, "orders/42", "/anything/%2e%2e/else"));
    }

    /// Attacks: each path could reach `orders/43` (or another object) at some upstream while
    /// its text starts with, or equals, the resource held.
    #[test]
    fn ambiguous_paths_are_refused_whatever_the_resource() {
        for path in [
            "/orders/42/../43",
            "/orders/42/%2e%2e/43",
            "/orders/42/%2E%2E/43",
            "/orders%2F43",
            "/orders/4%32",
            "/orders//42",
            "/orders/42/",
            "/orders/42/.",
            "/./orders/42",
            "/orders/42;jsessionid=1",
            "/orders/42.",
            "/orders/...",
            "/orders/\u{ff14}\u{ff12}",
            "/orders/{42}",
            "/orders/42|43",
            "/orders/[42]",
            "/orders/42\\..\\43",
            "/",
            "orders/42",
            "*",
        ] {
            for binding in [Path, PathPrefix] {
                let resource = path.trim_start_matches('/');
                let err = binding.check(resource, path).unwrap_err();
                assert!(err.contains(&format!("{path:?}")), "{err}");
                let err = binding.check("orders/42", path).unwrap_err();
                assert!(err.contains("--bind-resource"), "{err}");
            }
        }
    }

    /// Property: a path the binding accepts reads the same however an upstream normalises it:
    /// percent-decoding, RFC 3986 dot-segment removal, dropping `;` parameters, `\` as `/`, and
    /// merging `//` all leave it unchanged. Paths are generated from the pieces attacks use.
    #[test]
    fn accepted_paths_have_one_reading() {
        use rand::{RngExt, SeedableRng};
        const PIECES: [&str; 18] = [
            "a", "42", "orders", ".", "..", "", "%2e", "%2F", ";x", "\\", "b.c", "..a", "~", "%",
            "\u{ff14}", "x.", "|", "A",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut accepted = 0;
        for _ in 0..20_000 {
            let segments = rng.random_range(1..5);
            let path: String = (0..segments)
                .map(|_| {
                    let parts = rng.random_range(1..3);
                    let segment: String = (0..parts)
                        .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                        .collect();
                    format!("/{segment}")
                })
                .collect();
            let resource = &path[1..];
            if Path.check(resource, &path).is_ok() {
                accepted += 1;
                assert_eq!(normalised(&path), path, "{path:?} reads as another path");
            }
        }
        assert!(accepted > 1_000, "only {accepted} generated paths accepted");
    }

    /// What a lenient upstream could make of `path` (besides case, which the docs leave to it):
    /// percent-decoding, Unicode normalisation (here of one digit), `\` as `/`, `;` parameters
    /// and trailing dots dropped, dot segments removed, `//` merged.
    fn normalised(path: &str) -> String {
        let decoded = path
            .replace('\u{ff14}', "4")
            .replace("%2e", ".")
            .replace("%2E", ".")
            .replace("%2F", "/")
            .replace("%2f", "/")
            .replace('\\', "/");
        let mut out: Vec<&str> = Vec::new();
        for segment in decoded.split('/').skip(1) {
            let segment = segment.split(';').next().unwrap_or("");
            let segment = match segment {
                "." | ".." => segment,
                s => s.trim_end_matches('.'),
            };
            match segment {
                "" | "." => {}
                ".." => {
                    out.pop();
                }
                s => out.push(s),
            }
        }
        format!("/{}", out.join("/"))
    }
}
