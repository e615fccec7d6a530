//! The authorization policy of `--auth-policy FILE`: which identity may do which operation on
//! which resources. Read once at start and checked strictly, so a typo stops the node with the
//! line it is on instead of silently granting or refusing.
//!
//! ```toml
//! # The orders service (client certificate CN=orders-svc) and the CI runner's token share the
//! # tenant "orders".
//! [[grant]]
//! identities = ["cert:orders-svc", "token:ci-runner"]
//! resources = ["orders/"]
//! operations = ["acquire", "renew", "release", "describe"]
//!
//! [[grant]]
//! identities = ["cert:ops"]
//! operations = ["status", "admin"]
//! ```
//!
//! Identities: `cert:<common name>` (a client certificate of `--tls-client-ca`),
//! `token:<name>` (a bearer token of `--auth-tokens`), `anonymous` (neither). Resources: `"*"`
//! (every resource), a prefix ending in `/` (`"orders/"`: every resource under it), or an exact
//! resource name. Anything a grant does not give is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Longest identity name (after `cert:` or `token:`); a longer certificate name is never granted.
pub const IDENTITY_NAME_MAX_BYTES: usize = 128;

/// What a caller asks to do. The lock operations act on a resource; `status` and `admin` on the
/// cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operation {
    Acquire,
    Renew,
    Release,
    Describe,
    /// `lockd.v1.Cluster/Status`.
    Status,
    /// Administrative RPCs: `SigningKeys` and `RotateSigningKey` today (membership, leader
    /// transfer and snapshots when they come).
    Admin,
}

impl Operation {
    pub const ALL: [Operation; 6] = [
        Operation::Acquire,
        Operation::Renew,
        Operation::Release,
        Operation::Describe,
        Operation::Status,
        Operation::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Acquire => "acquire",
            Operation::Renew => "renew",
            Operation::Release => "release",
            Operation::Describe => "describe",
            Operation::Status => "status",
            Operation::Admin => "admin",
        }
    }

    /// Whether the operation acts on one resource (and so needs `resources` in a grant).
    pub fn on_resource(self) -> bool {
        !matches!(self, Operation::Status | Operation::Admin)
    }

    fn parse(s: &str) -> Option<Self> {
        Operation::ALL.into_iter().find(|op| op.as_str() == s)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// Which resources a grant covers.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Resources {
    All,
    /// Ends with `/`.
    Prefix(String),
    Exact(String),
}

impl Resources {
    fn covers(&self, resource: &str) -> bool {
        match self {
            Resources::All => true,
            Resources::Prefix(p) => resource.starts_with(p.as_str()),
            Resources::Exact(r) => resource == r,
        }
    }
}

/// One grant, as it applies to one identity.
#[derive(Clone, Debug)]
struct Rule {
    /// Bit set of [`Operation::bit`].
    operations: u8,
    resources: Vec<Resources>,
}

/// A checked policy: the rules of every identity it names.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    rules: BTreeMap<String, Vec<Rule>>,
}

impl Policy {
    /// Reads and checks the policy file; the error names the file, the line and the value.
    pub fn load(path: &Path) -> Result<Policy, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--auth-policy {}: {e}", path.display()))?;
        Policy::parse(&text).map_err(|e| format!("--auth-policy {}: {e}", path.display()))
    }

    /// Parses policy text (TOML, see the module docs).
    pub fn parse(text: &str) -> Result<Policy, String> {
        let doc = toml_edit::Document::parse(text)
            .map_err(|e| format!("not valid TOML: {}", one_line(&e.to_string())))?;
        let line = |span: Option<std::ops::Range<usize>>| -> String {
            span.map(|s| format!("line {}: ", line_of(text, s.start)))
                .unwrap_or_default()
        };
        let mut policy = Policy::default();
        for (key, item) in doc.as_table().iter() {
            if key != "grant" {
                return Err(format!(
                    "{}unknown key {key:?}: a policy has only [[grant]] tables",
                    line(item.span())
                ));
            }
        }
        let Some(grants) = doc.as_table().get("grant") else {
            return Err(
                "no [[grant]] table: the policy would refuse everything; write at least one grant"
                    .to_owned(),
            );
        };
        let grants = grants.as_array_of_tables().ok_or_else(|| {
            format!(
                "{}\"grant\" must be written as [[grant]] tables",
                line(grants.span())
            )
        })?;
        for grant in grants.iter() {
            let at = line(grant.span());
            let mut identities = None;
            let mut operations = None;
            let mut resources = None;
            for (key, item) in grant.iter() {
                let at = line(item.span().or(grant.span()));
                let values = strings(item).map_err(|e| format!("{at}{key:?} {e}"))?;
                match key {
                    "identities" => identities = Some((values, at)),
                    "operations" => operations = Some((values, at)),
                    "resources" => resources = Some((values, at)),
                    other => {
                        return Err(format!(
                            "{at}unknown key {other:?} in a grant (use identities, resources, \
                             operations)"
                        ));
                    }
                }
            }
            let (identities, id_at) =
                identities.ok_or_else(|| format!("{at}a grant without \"identities\""))?;
            let (operations, op_at) =
                operations.ok_or_else(|| format!("{at}a grant without \"operations\""))?;
            for id in &identities {
                check_identity(id).map_err(|e| format!("{id_at}{e}"))?;
            }
            let mut ops = 0u8;
            let mut on_resource = false;
            for op in &operations {
                let parsed = Operation::parse(op).ok_or_else(|| {
                    format!(
                        "{op_at}unknown operation {op:?} (one of acquire, renew, release, \
                         describe, status, admin)"
                    )
                })?;
                on_resource |= parsed.on_resource();
                ops |= parsed.bit();
            }
            let resources = match (resources, on_resource) {
                (Some((r, r_at)), true) => r
                    .iter()
                    .map(|r| parse_resources(r).map_err(|e| format!("{r_at}{e}")))
                    .collect::<Result<Vec<_>, _>>()?,
                (None, true) => {
                    return Err(format!(
                        "{op_at}operations {operations:?} act on resources, but the grant has no \
                         \"resources\" (use [\"*\"] for every resource)"
                    ));
                }
                (Some((_, r_at)), false) => {
                    return Err(format!(
                        "{r_at}\"resources\" in a grant of {operations:?} only: status and admin \
                         act on the cluster, not on resources; remove it"
                    ));
                }
                (None, false) => Vec::new(),
            };
            for id in identities {
                policy.rules.entry(id).or_default().push(Rule {
                    operations: ops,
                    resources: resources.clone(),
                });
            }
        }
        Ok(policy)
    }

    /// Whether `identity` may do `op` (on `resource`, for the lock operations).
    pub fn allows(&self, identity: &str, op: Operation, resource: Option<&str>) -> bool {
        let Some(rules) = self.rules.get(identity) else {
            return false;
        };
        rules.iter().any(|rule| {
            rule.operations & op.bit() != 0
                && match resource {
                    Some(r) => rule.resources.iter().any(|p| p.covers(r)),
                    None => !op.on_resource(),
                }
        })
    }

    /// Whether the policy names `identity` (so metrics may carry it as a label).
    pub fn names(&self, identity: &str) -> bool {
        self.rules.contains_key(identity)
    }

    /// The identities the policy names.
    pub fn identities(&self) -> BTreeSet<&str> {
        self.rules.keys().map(String::as_str).collect()
    }
}

/// An array of strings (non-empty, no duplicates).
fn strings(item: &toml_edit::Item) -> Result<Vec<String>, String> {
    let array = item
        .as_array()
        .ok_or_else(|| format!("must be an array of strings, not {}", item.type_name()))?;
    let mut out = Vec::new();
    for v in array.iter() {
        let s = v
            .as_str()
            .ok_or_else(|| format!("must hold strings only, not {}", v.type_name()))?;
        if out.iter().any(|o: &String| o == s) {
            return Err(format!("lists {s:?} twice"));
        }
        out.push(s.to_owned());
    }
    if out.is_empty() {
        return Err("is empty".to_owned());
    }
    Ok(out)
}

/// `anonymous`, `cert:<name>` or `token:<name>`.
pub fn check_identity(id: &str) -> Result<(), String> {
    if id == "anonymous" {
        return Ok(());
    }
    let name = id
        .strip_prefix("cert:")
        .or_else(|| id.strip_prefix("token:"))
        .ok_or_else(|| {
            if id.starts_with("node:") {
                format!(
                    "identity {id:?}: nodes act only for the callers whose calls they forward; \
                     they cannot be granted anything"
                )
            } else {
                format!(
                    "identity {id:?} must be \"cert:<certificate common name>\", \
                     \"token:<token name>\" or \"anonymous\""
                )
            }
        })?;
    if name.is_empty() || name.len() > IDENTITY_NAME_MAX_BYTES {
        return Err(format!(
            "identity {id:?}: the name must have 1 to {IDENTITY_NAME_MAX_BYTES} bytes"
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("identity {id:?} contains a control character"));
    }
    Ok(())
}

fn parse_resources(r: &str) -> Result<Resources, String> {
    if r == "*" {
        return Ok(Resources::All);
    }
    if r.is_empty() {
        return Err("resource \"\" is empty (use \"*\" for every resource)".to_owned());
    }
    if r.contains('*') {
        return Err(format!(
            "resource {r:?}: \"*\" stands alone; write a prefix as \"orders/\" (every resource \
             under orders/)"
        ));
    }
    if r.chars().any(char::is_control) {
        return Err(format!("resource {r:?} contains a control character"));
    }
    Ok(if r.ends_with('/') {
        Resources::Prefix(r.to_owned())
    } else {
        Resources::Exact(r.to_owned())
    })
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
# tenant orders
[[grant]]
identities = ["cert:orders-svc", "token:ci"]
resources = ["orders/", "global-lock"]
operations = ["acquire", "renew", "release", "describe"]

[[grant]]
identities = ["cert:ops"]
operations = ["status", "admin"]

[[grant]]
identities = ["anonymous"]
resources = ["*"]
operations = ["describe"]
"#;

    #[test]
    fn grants_cover_exactly_what_they_say() {
        let p = Policy::parse(EXAMPLE).unwrap();
        assert!(p.allows("cert:orders-svc", Operation::Acquire, Some("orders/1")));
        assert!(p.allows("token:ci", Operation::Release, Some("global-lock")));
        // A prefix ends with '/': "orders/" is not "orders-eu/".
        assert!(!p.allows("cert:orders-svc", Operation::Acquire, Some("orders-eu/1")));
        assert!(!p.allows("cert:orders-svc", Operation::Acquire, Some("global-lock/x")));
        assert!(!p.allows("cert:orders-svc", Operation::Status, None));
        assert!(p.allows("cert:ops", Operation::Status, None));
        assert!(p.allows("cert:ops", Operation::Admin, None));
        assert!(!p.allows("cert:ops", Operation::Describe, Some("orders/1")));
        assert!(p.allows("anonymous", Operation::Describe, Some("x")));
        assert!(!p.allows("anonymous", Operation::Acquire, Some("x")));
        assert!(!p.allows("cert:someone", Operation::Describe, Some("x")));
        // A lock operation without a resource is never allowed.
        assert!(!p.allows("token:ci", Operation::Acquire, None));
        assert!(p.names("token:ci") && !p.names("token:other"));
    }

    #[test]
    fn bad_policies_name_the_line_and_the_value() {
        let cases = [
            (
                "[[grant]]\nidentities = [\"alice\"]\noperations = [\"status\"]\n",
                "line 2",
                "\"alice\"",
            ),
            (
                "[[grant]]\nidentities = [\"cert:a\"]\noperations = [\"aquire\"]\nresources = [\"*\"]\n",
                "line 3",
                "\"aquire\"",
            ),
            (
                "[[grant]]\nidentities = [\"cert:a\"]\noperations = [\"acquire\"]\n",
                "line 3",
                "resources",
            ),
            (
                "[[grant]]\nidentities = [\"cert:a\"]\noperations = [\"status\"]\nresources = [\"a/\"]\n",
                "line 4",
                "remove it",
            ),
            (
                "[[grant]]\nidentities = [\"cert:a\"]\nresources = [\"a/*\"]\noperations = [\"acquire\"]\n",
                "line 3",
                "\"a/*\"",
            ),
            (
                "[[grant]]\nidentities = [\"cert:a\"]\noperations = [\"status\"]\nextra = 1\n",
                "line 4",
                "\"extra\"",
            ),
            (
                "[[grant]]\nidentities = [\"node:2\"]\noperations = [\"status\"]\n",
                "line 2",
                "node:2",
            ),
            (
                "[[grant]]\nidentities = []\noperations = [\"status\"]\n",
                "line 2",
                "empty",
            ),
            (
                "[[grant]]\nidentities = \"cert:a\"\noperations = [\"status\"]\n",
                "line 2",
                "array",
            ),
            (
                "[[grant]]\noperations = [\"status\"]\n",
                "line 1",
                "identities",
            ),
            ("allow = 1\n", "line 1", "\"allow\""),
            ("", "", "no [[grant]]"),
            ("[[grant]\n", "", "not valid TOML"),
        ];
        for (text, at, what) in cases {
            let e = Policy::parse(text).unwrap_err();
            assert!(e.contains(at) && e.contains(what), "{text:?}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
