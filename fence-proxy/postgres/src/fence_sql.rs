//! The SQL the proxy runs inside client transactions: the fence record and the read-only guard.
//!
//! No client-supplied text is ever spliced into SQL: the resource travels hex-encoded and the
//! token as digits, so the statements are injection-proof whatever the resource contains and
//! whatever `standard_conforming_strings` says.

use lockd_fence::Fence;

/// Validated table name: one or two plain identifiers (`lockd_fence`, `ops.lockd_fence`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceTable(String);

impl FenceTable {
    pub fn parse(name: &str) -> Result<Self, String> {
        let ok = !name.is_empty()
            && name.split('.').count() <= 2
            && name.split('.').all(|part| {
                let mut chars = part.chars();
                matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
                    && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                    && part.len() <= 63
            });
        if ok {
            Ok(FenceTable(name.to_owned()))
        } else {
            Err(format!(
                "fence table {name:?} must be [schema.]name of lower-case letters, digits and _"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// DDL that creates the table if it is missing.
    pub fn create_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (resource text PRIMARY KEY, token bigint NOT NULL, \
             updated_at timestamptz NOT NULL)",
            self.0
        )
    }
}

/// The largest token the `bigint` column holds.
pub const MAX_RECORDABLE_TOKEN: u64 = i64::MAX as u64;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A DO block that records `fence` in the fence table, inside the current transaction.
///
/// The upsert takes the row lock on the resource's record, so concurrent transactions of two
/// holders serialise there: the older holder's transaction either commits before the newer one
/// records its token, or it finds the newer token and fails with 55P03. The table is created when
/// it is missing (it normally exists: the proxy creates it at start-up through its own pool).
pub fn record_fence_sql(table: &FenceTable, fence: &Fence) -> String {
    debug_assert!(fence.token.0 <= MAX_RECORDABLE_TOKEN);
    let t = table.as_str();
    format!(
        r#"DO $lockd_fence$
DECLARE
  v_resource text := convert_from(decode('{res}', 'hex'), 'UTF8');
  v_token bigint := {token};
  v_highest bigint;
BEGIN
  IF to_regclass('{t}') IS NULL THEN
    CREATE TABLE IF NOT EXISTS {t} (resource text PRIMARY KEY, token bigint NOT NULL, updated_at timestamptz NOT NULL);
  END IF;
  INSERT INTO {t} AS f (resource, token, updated_at) VALUES (v_resource, v_token, now())
  ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
  WHERE f.token <= EXCLUDED.token;
  IF NOT FOUND THEN
    SELECT f.token INTO v_highest FROM {t} AS f WHERE f.resource = v_resource;
    RAISE EXCEPTION USING
      ERRCODE = '55P03',
      MESSAGE = format('fence-proxy: stale fencing token %s for %s: highest accepted is %s',
                       v_token, to_json(v_resource)::text, v_highest),
      DETAIL = format('resource=%s token=%s highest=%s', to_json(v_resource)::text, v_token, v_highest),
      HINT = 'This session no longer holds the lock: nothing of this transaction was applied. Roll back, acquire the lock again and SET lockd.fence to the new token.';
  END IF;
END
$lockd_fence$"#,
        res = hex(fence.resource.as_bytes()),
        token = fence.token.0,
    )
}

/// Makes the current transaction read-only for good: `set_config` runs inside a SELECT, so a
/// snapshot is taken first and Postgres then refuses any later switch back to read-write.
pub const READ_ONLY_SQL: &str = "SELECT pg_catalog.set_config('transaction_read_only', 'on', true)";

/// A DO block that raises a proxy error from inside the upstream, used where a Parse message must
/// be refused but the reply has to stay in the upstream's response order.
pub fn raise_sql(code: &str, message: &str) -> String {
    debug_assert!(code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric()));
    format!(
        "DO $lockd_fence$ BEGIN RAISE EXCEPTION USING ERRCODE = '{code}', MESSAGE = \
         convert_from(decode('{}', 'hex'), 'UTF8'); END $lockd_fence$",
        hex(message.as_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        assert!(FenceTable::parse("lockd_fence").is_ok());
        assert!(FenceTable::parse("ops.lockd_fence").is_ok());
        for bad in ["", "a.b.c", "x;drop", "Upper", "1abc", "a b"] {
            assert!(FenceTable::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn resource_travels_hex_encoded() {
        let fence: Fence = "it's$lockd_fence$:7".parse().unwrap();
        let sql = record_fence_sql(&FenceTable::parse("lockd_fence").unwrap(), &fence);
        assert!(!sql.contains("it's"), "{sql}");
        assert!(sql.contains(&hex(b"it's$lockd_fence$")));
        assert!(sql.contains("v_token bigint := 7;"));
    }
}
