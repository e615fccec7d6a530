//! The fence table lost: whoever owns its schema (a database owner owns `public`) may drop it,
//! and with it every token it recorded. A new empty table must not accept a stale holder.

use lockd_tests::pg;

/// What a test made: its data table, its schema (with the fence table), the schema's record in
/// `init`'s table, its role.
fn cleanup(schema: &str, role: &str, data: &str) -> pg::SqlOnDrop {
    pg::SqlOnDrop(vec![
        format!("DROP TABLE IF EXISTS {data}"),
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
        format!(
            "DELETE FROM lockd_fence_proxy.fence_tables WHERE fence_table = '{schema}.lockd_fence'"
        ),
        format!("DROP ROLE IF EXISTS {role}"),
    ])
}

fn init(table: &str, token_floor: Option<u64>) -> anyhow::Result<String> {
    pg::try_init(fence_proxy_postgres::InitArgs {
        upstream: pg::direct_url(),
        fence_table: table.to_owned(),
        grant_to: Vec::new(),
        require_verified: false,
        token_floor,
    })
}

/// Goal: once a fence table recorded tokens, losing it loses no fence. The owner of the table's
/// schema (since Postgres 15 a database's owner owns `public`, where the default table lives)
/// may drop a table it has no privilege on; the guard then fails every fenced transaction
/// (closed), and its hint sent the operator to rerun `init`, which created the table again,
/// empty: the holder of 41, superseded by 42, then wrote again.
/// Method: a schema owned by role `o` (as `public` is by a database owner), `init` of
/// `<schema>.lockd_fence` as postgres, a proxy; the holder of 42 writes; `o` drops the table.
/// Fenced writes fail; `init` without `--token-floor` is refused naming the flag; with
/// `--token-floor 42` the stale 41 is refused with 55P03 and 42 and 43 write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_dropped_fence_table_is_not_recreated_empty() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let role = pg::unique_name("lost_owner");
    let schema = pg::unique_name("lost_schema");
    let data = pg::unique_name("lost_rows");
    let _cleanup = cleanup(&schema, &role, &data);
    direct
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; CREATE SCHEMA {schema} AUTHORIZATION {role}; \
             CREATE TABLE {data} (token bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let table = format!("{schema}.lockd_fence");
    init(&table, None).expect("first init");
    let proxy = pg::PgProxy::start_args(pg::proxy_args(pg::direct_url(), table.clone(), false));
    let resource = pg::unique_name("lost");
    let write = |token: u64| {
        let config = proxy.config(Some(&format!("{resource}:{token}")));
        let data = data.clone();
        async move {
            let c = pg::connect(&config).await;
            c.batch_execute(&format!("INSERT INTO {data} VALUES ({token})"))
                .await
                .map_err(|e| e.code().map(|c| c.code().to_owned()).unwrap_or_default())
        }
    };
    write(42).await.expect("the holder of 42 writes");

    let owner = pg::connect(
        &format!(
            "postgres://{role}@{}:{}/{}",
            pg::PG_HOST,
            pg::PG_PORT,
            pg::PG_DATABASE
        )
        .parse()
        .unwrap(),
    )
    .await;
    owner
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .expect("the owner of the schema drops the fence table it has no privilege on");
    assert_eq!(
        write(42).await,
        Err("55000".to_owned()),
        "a fenced write with the table gone"
    );

    let refused = init(&table, None);
    eprintln!("init without --token-floor after the loss -> {refused:?}");
    let message = format!(
        "{:#}",
        refused.expect_err("init recreated the lost table empty")
    );
    assert!(
        message.contains("--token-floor") && message.contains(&table),
        "the refusal names the table and the flag: {message}"
    );
    assert_eq!(write(41).await, Err("55000".to_owned()), "still closed");

    // The schema's owner puts a table of its own there, with a trigger that an UPDATE by the
    // role running init would run as that role: init must not touch it.
    owner
        .batch_execute(&format!(
            "CREATE TABLE {schema}.spied (who text); GRANT INSERT ON {schema}.spied TO PUBLIC; \
             CREATE TABLE {table} (resource text PRIMARY KEY, token bigint NOT NULL, \
             updated_at timestamptz NOT NULL); \
             CREATE FUNCTION {schema}.spy() RETURNS trigger LANGUAGE plpgsql AS \
             $f$ BEGIN INSERT INTO {schema}.spied VALUES (current_user); RETURN NULL; END $f$; \
             CREATE TRIGGER spy BEFORE UPDATE OR INSERT ON {table} \
             FOR EACH STATEMENT EXECUTE FUNCTION {schema}.spy()"
        ))
        .await
        .unwrap();
    let adopted = init(&table, Some(42));
    eprintln!("init --token-floor 42 over the owner's own table -> {adopted:?}");
    let spied: i64 = direct
        .query_one(&format!("SELECT count(*) FROM {schema}.spied"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        spied, 0,
        "init ran the schema owner's trigger as its own role"
    );
    let message = format!("{:#}", adopted.expect_err("init adopted a foreign table"));
    assert!(message.contains("does not adopt"), "{message}");
    assert_eq!(write(42).await, Err("55000".to_owned()), "a foreign table");
    owner
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();

    assert!(
        format!("{:#}", init(&table, Some(0)).expect_err("a floor of 0"))
            .contains("--token-floor 0")
    );
    let over = init(&table, Some(i64::MAX as u64 + 1)).expect_err("a floor above bigint");
    assert!(format!("{over:#}").contains("--token-floor 9223372036854775808"));
    init(&table, Some(42)).expect("init with --token-floor 42");
    assert_eq!(
        write(41).await,
        Err("55P03".to_owned()),
        "the superseded holder of 41 after the table was recreated"
    );
    write(42).await.expect("the holder of 42 writes again");
    write(43).await.expect("a newer holder raises");
    assert_eq!(write(42).await, Err("55P03".to_owned()), "42 after 43");
    let stale: i64 = direct
        .query_one(
            &format!("SELECT count(*) FROM {data} WHERE token = 41"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stale, 0, "a row of the superseded holder committed");
    // Rerunning init on the recreated table needs no floor and keeps the one set.
    init(&table, None).expect("init again on the table it recorded");
    assert_eq!(write(41).await, Err("55P03".to_owned()), "the floor stays");
}

/// Goal: `init --token-floor N` leaves no recorded token below N, also of a guard transaction
/// still open while init runs: its row, inserted and not yet committed, is one init's UPDATE
/// cannot see, and the same holder's later transactions read that row without the floor.
/// Method: a table of its own (no loss needed: a floor may be set any time); holder H, fenced
/// `r:5`, opens a block and writes (its opening guard inserts the row of 5); `init
/// --token-floor 100` runs meanwhile; H commits; then the row must read 100 and a new session
/// fenced `r:5` must be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_floor_raises_the_rows_of_guards_still_open() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let role = pg::unique_name("floor_unused");
    let schema = pg::unique_name("floor_schema");
    let data = pg::unique_name("floor_rows");
    let _cleanup = cleanup(&schema, &role, &data);
    direct
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {data} (token bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let table = format!("{schema}.lockd_fence");
    init(&table, None).expect("first init");
    let proxy = pg::PgProxy::start_args(pg::proxy_args(pg::direct_url(), table.clone(), false));
    let resource = pg::unique_name("floor");
    let holder = pg::connect(&proxy.config(Some(&format!("{resource}:5")))).await;
    holder
        .batch_execute(&format!("BEGIN; INSERT INTO {data} VALUES (5)"))
        .await
        .unwrap();
    let floor = {
        let table = table.clone();
        std::thread::spawn(move || init(&table, Some(100)))
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    holder
        .batch_execute("COMMIT")
        .await
        .expect("the holder commits");
    floor.join().unwrap().expect("init --token-floor 100");
    let recorded: i64 = direct
        .query_one(
            &format!("SELECT token FROM {table} WHERE resource = $1"),
            &[&resource],
        )
        .await
        .unwrap()
        .get(0);
    let again = pg::connect(&proxy.config(Some(&format!("{resource}:5")))).await;
    let wrote = again
        .batch_execute(&format!("INSERT INTO {data} VALUES (5)"))
        .await
        .map_err(|e| e.code().map(|c| c.code().to_owned()).unwrap_or_default());
    eprintln!("recorded after init: {recorded}; token 5 writes again -> {wrote:?}");
    assert_eq!(recorded, 100, "a row below the floor survived init");
    assert_eq!(
        wrote,
        Err("55P03".to_owned()),
        "token 5 below the floor of 100"
    );
}
