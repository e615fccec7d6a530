//! `fence-proxy epochs max`: the highest token a store has accepted, over all resources.
//!
//! After losing a lock cluster, it is restored from a backup with `lockd restore --token-floor
//! N`: N must be at least every token any store accepted, or a restored cluster could hand out
//! a token a store has already seen, and two holders would pass the fence. Run this against
//! every store and take the largest.

use std::process::ExitCode;
use std::time::Duration;

use fence_epoch_store::postgres_store::DEFAULT_TABLE;
use fence_epoch_store::{StoreOptions, StoreSpec, Timing};

/// Flags of `fence-proxy epochs max`.
#[derive(clap::Args, Debug)]
pub struct MaxArgs {
    /// An epoch store, as `fence-proxy http --store` takes it: `redb:PATH` or a postgres:// URL.
    #[arg(long, value_name = "SPEC", conflicts_with = "upstream")]
    store: Option<StoreSpec>,
    /// Table of a Postgres epoch store.
    #[arg(long, default_value = DEFAULT_TABLE, requires = "store")]
    store_table: String,
    /// A database guarded by the Postgres front end (its fence table is read).
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,
    /// The fence table of that database.
    #[arg(long, default_value = fence_proxy_postgres::DEFAULT_FENCE_TABLE, requires = "upstream")]
    fence_table: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What was read: the source's name, resources, and the highest token with its resource.
struct Read {
    source: String,
    /// The schema-qualified table read (Postgres only).
    table: Option<String>,
    resources: u64,
    highest: Option<(String, u64)>,
}

pub fn run_max(args: &MaxArgs) -> ExitCode {
    let runtime = match crate::one_shot_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(read(args)) {
        Ok(read) => {
            let highest = read.highest.as_ref().map_or(0, |(_, t)| *t);
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "source": read.source,
                        "table": read.table,
                        "resources": read.resources,
                        "highest_token": highest,
                        "resource": read.highest.as_ref().map(|(r, _)| r.clone()),
                    })
                );
            } else {
                match &read.highest {
                    Some((resource, token)) => println!(
                        "{token}\t(highest token in {}, for resource {resource:?}; {} resources)",
                        read.source, read.resources
                    ),
                    None => println!("0\t({} holds no token)", read.source),
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fence-proxy: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn read(args: &MaxArgs) -> anyhow::Result<Read> {
    if let Some(spec) = &args.store {
        let options = StoreOptions {
            timing: Timing {
                store_timeout: Duration::from_secs(10),
                ..Timing::default()
            },
            postgres_table: args.store_table.clone(),
            ..StoreOptions::default()
        };
        let max = spec.epochs_max(&options).await?;
        // The table found through the search_path, schema-qualified, so the operator can check
        // it is the one the proxy writes (its --store-table, under the same role).
        let source = match &max.table {
            Some(table) => format!("{spec}, table {table}"),
            None => spec.to_string(),
        };
        return Ok(Read {
            source,
            table: max.table,
            resources: max.resources,
            highest: max.highest.map(|(r, t)| (r, t.0)),
        });
    }
    let upstream = args.upstream.as_deref().ok_or_else(|| {
        anyhow::anyhow!(
            "say which store to read: --store redb:PATH | --store postgres://... (an epoch \
                 store) or --upstream postgres://... (a fence table)"
        )
    })?;
    let max = fence_proxy_postgres::epochs::fence_table_max(upstream, &args.fence_table).await?;
    Ok(Read {
        source: format!("fence table {}", max.table),
        table: Some(max.table),
        resources: max.resources,
        highest: max.highest,
    })
}
