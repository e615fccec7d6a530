//! The highest token recorded in a fence table (`fence-proxy epochs max --upstream URL`): the
//! floor a lock cluster restored from a backup must start above, for databases guarded by the
//! Postgres front end.

use crate::fence_sql::FenceTable;

/// What a fence table holds, in brief.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceTableMax {
    /// `schema.table` read.
    pub table: String,
    /// Resources with a recorded fence.
    pub resources: u64,
    /// The highest recorded token and its resource (first by name among equals); `None` for an
    /// empty table.
    pub highest: Option<(String, u64)>,
}

/// How long the read waits for its connection: an operator's command, as `init`'s.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads the highest token of `fence_table` in the `upstream` database with one statement (the
/// role needs read access to the table: the role that ran `fence-proxy postgres init` has it).
/// The connection is made as the proxy makes its own (`--upstream`'s TLS settings apply).
pub async fn fence_table_max(upstream: &str, fence_table: &str) -> anyhow::Result<FenceTableMax> {
    use sqlx::Connection;
    let table =
        FenceTable::parse(fence_table).map_err(|e| anyhow::anyhow!("--fence-table: {e}"))?;
    let parsed = crate::upstream::parse(upstream, "--upstream")?;
    let shown = crate::upstream::redact(upstream);
    let mut conn = parsed
        .connect(CONNECT_TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("connecting to --upstream {shown:?}: {e:#}"))?;
    let qualified = table.qualified();
    // The name is validated plain identifiers (FenceTable::parse), so it is safe in the text.
    let result: Result<Option<(i64, String, i64)>, sqlx::Error> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {qualified})::bigint, resource, token \
             FROM {qualified} ORDER BY token DESC, resource LIMIT 1"
        )))
        .fetch_optional(&mut conn)
        .await;
    let _ = conn.close().await;
    let row = result.map_err(|e| {
        anyhow::anyhow!(
            "reading {qualified} through {shown:?}: {}",
            crate::upstream::sqlx_message(&e)
        )
    })?;
    Ok(match row {
        Some((count, resource, token)) => FenceTableMax {
            table: qualified,
            resources: u64::try_from(count).unwrap_or(0),
            highest: Some((resource, u64::try_from(token).unwrap_or(0))),
        },
        None => FenceTableMax {
            table: qualified,
            resources: 0,
            highest: None,
        },
    })
}
