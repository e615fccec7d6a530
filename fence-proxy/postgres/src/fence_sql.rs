//! The SQL of the fence: the table, the guard function that `fence-proxy postgres init` installs,
//! and the statements the proxy runs around client statements.
//!
//! The guard is a `SECURITY DEFINER` function owned by the role that ran `init`. It reads the
//! fence from the session itself (`current_setting('lockd.fence', true)`), so whatever spelling a
//! client used to set it (`SET "lockd"."fence"`, `set_config`, `ALTER ROLE ... SET`, startup
//! options), the value Postgres holds is the value checked. Every object inside it is
//! schema-qualified and its `search_path` is pinned to `pg_catalog, pg_temp`, so temporary tables
//! or a client's `search_path` cannot shadow anything; the table grants nothing to application
//! roles, so no client can lower or delete a fence row. The body contains no backslash, so it
//! compiles the same whatever `standard_conforming_strings` a session has.

/// Validated, schema-qualified table name (`public.lockd_fence`, `ops.fences`). The guard
/// function lives in the dedicated schema [`GUARD_SCHEMA`], owned by the role that ran `init`
/// (application roles get USAGE only), never in the table's schema: since Postgres 15 `public` is
/// owned by `pg_database_owner`, and the owner of a schema may drop any object in it, so a
/// database owner could replace a guard kept there with a no-op.
/// The guard is named after the table: `lockd_fence_guard` for `public.lockd_fence`,
/// `<schema>__<table>_guard` for other schemas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceTable {
    schema: String,
    table: String,
}

/// Longest table name accepted: Postgres truncates identifiers at 63 bytes, and the guard
/// function's name adds `_guard` (6 bytes) to it.
const MAX_TABLE_NAME_BYTES: usize = 63 - 6;

/// Longest identifier Postgres keeps without truncating (NAMEDATALEN - 1).
const MAX_IDENTIFIER_BYTES: usize = 63;

/// The schema of the guard functions. `init` creates it owned by its own role and refuses a
/// schema of that name owned by anyone else; the proxy's start-up check refuses a guard whose
/// schema is not owned by the guard's owner.
pub const GUARD_SCHEMA: &str = "lockd_fence_proxy";

impl FenceTable {
    /// Parses `[schema.]name` of plain lower-case identifiers; an unqualified name lives in
    /// `public`, so the proxy never depends on a session's `search_path`.
    pub fn parse(name: &str) -> Result<Self, String> {
        let plain = |part: &str| {
            let mut chars = part.chars();
            matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
                && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && part.len() <= MAX_TABLE_NAME_BYTES
        };
        let parts: Vec<&str> = name.split('.').collect();
        let (schema, table) = match parts.as_slice() {
            [t] => ("public", *t),
            [s, t] => (*s, *t),
            _ => ("", ""),
        };
        if plain(schema) && plain(table) && !schema.starts_with("pg_") && schema != GUARD_SCHEMA {
            let t = FenceTable {
                schema: schema.to_owned(),
                table: table.to_owned(),
            };
            let guard = t.guard_name();
            if guard.len() > MAX_IDENTIFIER_BYTES {
                return Err(format!(
                    "fence table {name:?}: the guard function's name {guard:?} would exceed {MAX_IDENTIFIER_BYTES} bytes; use shorter schema and table names"
                ));
            }
            Ok(t)
        } else {
            Err(format!(
                "fence table {name:?} must be [schema.]name of lower-case letters, digits and _ \
                 (at most {MAX_TABLE_NAME_BYTES} bytes each, schema not pg_* nor {GUARD_SCHEMA})"
            ))
        }
    }

    /// `schema.table`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The guard function's unqualified name.
    fn guard_name(&self) -> String {
        if self.schema == "public" {
            format!("{}_guard", self.table)
        } else {
            format!("{}__{}_guard", self.schema, self.table)
        }
    }

    /// `lockd_fence_proxy.<name>`, the guard function.
    pub fn guard_function(&self) -> String {
        format!("{GUARD_SCHEMA}.{}", self.guard_name())
    }

    /// The signature `to_regprocedure` looks up.
    pub fn guard_signature(&self) -> String {
        format!("{}(boolean, text[], boolean)", self.guard_function())
    }

    /// The statement the proxy runs to guard a transaction. `proofs`: the SQL array of the
    /// session's proofs (`verify::Proofs::sql_array`), `None` without `--verify-key`.
    /// `at_commit`: this guard runs right before the transaction's COMMIT (or PREPARE
    /// TRANSACTION), not before a statement of the client's.
    ///
    /// Without `require_fence` a second column says whether the session has no fence (`t`):
    /// the proxy then leaves out the opening guards of its next transactions, which would return
    /// at once. Every name in it is schema-qualified (the client's `search_path` applies here);
    /// it is read in the same statement as the guard, and safety never rests on it: the guard
    /// before each commit runs regardless.
    pub fn guard_call(&self, require_fence: bool, proofs: Option<&str>, at_commit: bool) -> String {
        let unfenced = if require_fence {
            String::new()
        } else {
            format!(", {UNFENCED_EXPR}")
        };
        format!(
            "SELECT {}({require_fence}, {}, {at_commit}){unfenced}",
            self.guard_function(),
            proofs.unwrap_or("NULL")
        )
    }

    /// Whether the guard function exists in the connected database as `init` installs it: a
    /// SECURITY DEFINER function in a schema owned by the function's owner (so nobody else can
    /// drop and replace it).
    pub fn exists_sql(&self) -> String {
        format!(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p \
             JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
             WHERE p.oid = pg_catalog.to_regprocedure('{}') \
             AND p.prosecdef AND n.nspowner = p.proowner)",
            self.guard_signature()
        )
    }

    /// Whether the guard in the connected database is of revision [`GUARD_REVISION_NUMBER`] or
    /// later: a proxy with `--verify-key` needs a guard that refuses proofs on a table without a
    /// proof key. The number is read from the guard's revision line, so that the guard of a
    /// later init (whose line says more) is accepted too; `false` when the line is missing, NULL
    /// (no row) when the guard is.
    pub fn revision_sql(&self) -> String {
        format!(
            "SELECT COALESCE(pg_catalog.substring(p.prosrc, '{GUARD_REVISION_PREFIX}([0-9]+)')::pg_catalog.numeric \
             OPERATOR(pg_catalog.>=) {GUARD_REVISION_NUMBER}, false) FROM pg_catalog.pg_proc p \
             WHERE p.oid = pg_catalog.to_regprocedure('{}')",
            self.guard_signature()
        )
    }

    /// What `fence-proxy postgres init` runs, in one transaction: the table (owned by the init
    /// role, no privilege for anyone else) and the guard function (EXECUTE only for the granted
    /// roles). Idempotent: running it again replaces the function and keeps the recorded fences.
    ///
    /// Each table init creates is recorded (`lockd_fence_proxy.fence_tables`, by oid). Whoever
    /// owns the table's schema (a database owner owns `public`) can drop it, and with it every
    /// token it recorded: a new empty table would then accept a stale holder's token. So when
    /// the recorded table is gone or replaced, init refuses unless `token_floor` is given, and
    /// the guard refuses every token below that floor (rows kept are raised to it).
    pub fn init_sql(&self, token_floor: Option<u64>) -> String {
        let t = self.qualified();
        let f = self.guard_function();
        let floor_given = token_floor.is_some();
        let floor = token_floor.unwrap_or(0);
        let raise_rows = match token_floor {
            // The lock waits for every guard transaction that wrote a row and has not
            // committed yet (a row this UPDATE could not see), and holds new ones back.
            Some(n) => format!(
                "LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE;\n\
                 UPDATE {t} SET token = {n}, updated_at = pg_catalog.now() WHERE token < {n};\n"
            ),
            None => String::new(),
        };
        format!(
            r#"SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('{guard_schema}'));
CREATE SCHEMA IF NOT EXISTS {guard_schema};
DO $lockd_init$
BEGIN
  IF (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = '{guard_schema}')
     IS DISTINCT FROM (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = CURRENT_USER) THEN
    RAISE EXCEPTION 'fence-proxy: schema {guard_schema} exists and is owned by another role than %, which could replace the guard function; drop or reassign it first', CURRENT_USER;
  END IF;
END
$lockd_init$;
REVOKE ALL ON SCHEMA {guard_schema} FROM PUBLIC;
CREATE TABLE IF NOT EXISTS {guard_schema}.fence_tables (
  fence_table text PRIMARY KEY,
  relid oid NOT NULL,
  token_floor bigint NOT NULL DEFAULT 0,
  recorded_at timestamptz NOT NULL);
REVOKE ALL ON TABLE {guard_schema}.fence_tables FROM PUBLIC;
DO $lockd_lost$
DECLARE
  v_recorded oid;
  v_at timestamptz;
BEGIN
  SELECT r.relid, r.recorded_at INTO v_recorded, v_at FROM {guard_schema}.fence_tables AS r WHERE r.fence_table = '{t}';
  IF FOUND AND pg_catalog.to_regclass('{t}') ::pg_catalog.oid IS DISTINCT FROM v_recorded AND NOT {floor_given} THEN
    RAISE EXCEPTION USING
      ERRCODE = '55000',
      MESSAGE = pg_catalog.format('fence-proxy: the fence table {t} that init created (recorded %s) is gone or was replaced: the tokens it recorded are lost, and a new table would accept a stale holder''s token; rerun init with --token-floor N, N at least the highest fencing token lockd has granted', v_at),
      HINT = 'Rerun init with --token-floor N, N at least the highest fencing token lockd has granted (the token of a fresh Acquire on any resource is above every earlier one); tokens below N are then refused.';
  END IF;
END
$lockd_lost$;
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {t} (resource text PRIMARY KEY, token bigint NOT NULL, updated_at timestamptz NOT NULL);
-- A table of that name that init did not make (the schema's owner may drop ours and create
-- one, with triggers or rules that the UPDATE below would run as this role) is never adopted.
DO $lockd_own$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                 WHERE c.oid = pg_catalog.to_regclass('{t}')
                   AND c.relkind = 'r'
                   AND c.relowner = (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = CURRENT_USER)) THEN
    RAISE EXCEPTION USING
      ERRCODE = '55000',
      MESSAGE = pg_catalog.format('fence-proxy: %s exists and is not an ordinary table owned by %s, the role running init: init does not adopt a table it did not make; drop it (its rows are no fences) and rerun init', '{t}', CURRENT_USER);
  END IF;
END
$lockd_own$;
REVOKE ALL ON TABLE {t} FROM PUBLIC;
INSERT INTO {guard_schema}.fence_tables AS r (fence_table, relid, token_floor, recorded_at)
VALUES ('{t}', pg_catalog.to_regclass('{t}'), {floor}, pg_catalog.now())
ON CONFLICT (fence_table) DO UPDATE SET relid = EXCLUDED.relid,
  token_floor = GREATEST(r.token_floor, EXCLUDED.token_floor),
  recorded_at = CASE WHEN r.relid OPERATOR(pg_catalog.=) EXCLUDED.relid THEN r.recorded_at ELSE EXCLUDED.recorded_at END;
{raise_rows}-- Proof keys (see verify.rs), one per fence table: a row only after init --require-verified;
-- then the guard of that table accepts only fence values a fence-proxy with --verify-key
-- verified. Nobody but its owner (and a proxy role it is granted to) may read them.
CREATE TABLE IF NOT EXISTS {guard_schema}.proof_key (
  fence_table text PRIMARY KEY,
  kin bytea NOT NULL CHECK (pg_catalog.octet_length(kin) = 64),
  kout bytea NOT NULL CHECK (pg_catalog.octet_length(kout) = 64));
REVOKE ALL ON TABLE {guard_schema}.proof_key FROM PUBLIC;
-- The guard of earlier versions took no proofs: a client could call it to record a fence the
-- proxy never verified.
DROP FUNCTION IF EXISTS {f}(boolean);
-- Nor whether it ran before COMMIT: a transaction that queued only a NOTIFY went through the
-- lock-free path there (see below). A proxy of that version fails closed after this init.
DROP FUNCTION IF EXISTS {f}(boolean, text[]);
CREATE OR REPLACE FUNCTION {f}(require_fence boolean, proofs text[], at_commit boolean) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $lockd_guard$
DECLARE
  v_fence text := pg_catalog.current_setting('lockd.fence', true);
  v_sep integer;
  v_resource text;
  v_digits text;
  v_token bigint;
  v_highest bigint;
  v_bad boolean;
  v_kin bytea;
  v_kout bytea;
  v_proof text;
  v_p integer;
  v_floor bigint;
BEGIN
  IF v_fence IS NULL OR v_fence = '' THEN
    IF require_fence THEN
      IF pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION USING
          ERRCODE = '25006',
          MESSAGE = 'fence-proxy: this session has no fence (lockd.fence is empty) and the proxy runs with --require-fence: a transaction that wrote cannot commit',
          HINT = 'SET lockd.fence = ''<resource>:<token>'' before writing.';
      END IF;
      -- READ ONLY is not a complete barrier: Postgres 15 lets a read-only transaction create
      -- and write large objects. What runs after this guard is the COMMIT, and the only
      -- client code a COMMIT runs is a WITH HOLD cursor's query (materialized then) and the
      -- deferred triggers that query queues: so none may be open.
      IF at_commit AND EXISTS (SELECT 1 FROM pg_catalog.pg_cursors AS c WHERE c.is_holdable) THEN
        RAISE EXCEPTION USING
          ERRCODE = '25006',
          MESSAGE = pg_catalog.format('fence-proxy: this session has no fence (lockd.fence is empty) and the proxy runs with --require-fence: WITH HOLD cursor %s is open, whose query would run at COMMIT, after the guard', pg_catalog.quote_ident((SELECT c.name FROM pg_catalog.pg_cursors AS c WHERE c.is_holdable LIMIT 1))),
          HINT = 'CLOSE the cursor, or SET lockd.fence = ''<resource>:<token>'' first: an unfenced session cannot hold a WITH HOLD cursor past a commit.';
      END IF;
      PERFORM pg_catalog.set_config('transaction_read_only', 'on', true);
    END IF;
    RETURN;
  END IF;
  -- A fenced transaction. The table must be the one init created and recorded (by oid): an
  -- ordinary table owned by this function's owner (CURRENT_USER inside SECURITY DEFINER).
  -- Whoever owns the table's schema (a database owner owns public) could otherwise drop it and
  -- create one of their own with lower tokens, and a table recreated by hand or restored from an
  -- older dump may hold lower tokens too: init then asks for --token-floor. Checked only here: an unfenced transaction never reads the table, and
  -- every guard call would pay for the lookup (pg_get_userbyid is a cache lookup, the pg_roles
  -- view a join).
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                 JOIN {guard_schema}.fence_tables AS r ON r.relid OPERATOR(pg_catalog.=) c.oid
                 WHERE c.oid = pg_catalog.to_regclass('{t}')
                   AND r.fence_table = '{t}'
                   AND c.relkind = 'r'
                   AND pg_catalog.pg_get_userbyid(c.relowner) = CURRENT_USER) THEN
    RAISE EXCEPTION USING
      ERRCODE = '55000',
      MESSAGE = pg_catalog.format('fence-proxy: the fence table {t} is missing, not an ordinary table, or not owned by %s, the owner of the guard: no transaction can be fenced', CURRENT_USER),
      HINT = 'Rerun fence-proxy postgres init as the role that owns the guard, after removing a foreign table; if the table was dropped, its recorded tokens are lost and init asks for --token-floor.';
  END IF;
  -- <resource>:<token>, the token being the digits after the last ':' (lockd's Fence rules).
  IF pg_catalog.strpos(v_fence, ':') = 0 THEN
    v_sep := 0;
    v_resource := '';
    v_digits := '';
  ELSE
    v_sep := pg_catalog.length(v_fence) - pg_catalog.strpos(pg_catalog.reverse(v_fence), ':') + 1;
    v_resource := pg_catalog.substr(v_fence, 1, v_sep - 1);
    v_digits := pg_catalog.substr(v_fence, v_sep + 1);
  END IF;
  SELECT k.kin, k.kout INTO v_kin, v_kout FROM {guard_schema}.proof_key AS k WHERE k.fence_table = '{t}';
  -- {revision}
  -- Proofs come only from a proxy with --verify-key: it takes plain tokens for unverified, so
  -- a table without a proof key (its row deleted while the proxy runs, a database the proxy
  -- never checked) must refuse, not fall back to taking the token from the value.
  IF NOT FOUND AND proofs IS NOT NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = '28000',
      MESSAGE = pg_catalog.format('fence-proxy: a fence-proxy with --verify-key guards this transaction, but the fence table {t} in database %s has no proof key: it would take any plain token', pg_catalog.to_json(pg_catalog.current_database())::text),
      HINT = 'Run fence-proxy postgres init --require-verified in this database and restart the proxy, or run the proxy without --verify-key.';
  END IF;
  IF FOUND THEN
    -- Verified fences only: the token comes from the proof, <token>:<mac>, whose MAC over this
    -- exact value and token only the proxy (holding the proof key) can make.
    IF v_sep > 0 AND proofs IS NOT NULL THEN
      FOREACH v_proof IN ARRAY proofs LOOP
        v_p := pg_catalog.strpos(v_proof, ':');
        IF v_p > 1 AND pg_catalog.substr(v_proof, v_p + 1) = pg_catalog.encode(pg_catalog.sha256(
             v_kout || pg_catalog.sha256(v_kin || pg_catalog.convert_to(
               v_fence || pg_catalog.chr(10) || pg_catalog.substr(v_proof, 1, v_p - 1), 'UTF8'))), 'hex') THEN
          v_token := pg_catalog.substr(v_proof, 1, v_p - 1)::bigint;
          EXIT;
        END IF;
      END LOOP;
    END IF;
    IF v_token IS NULL THEN
      IF v_sep > 0 AND v_digits OPERATOR(pg_catalog.~) '^[0-9]+$' THEN
        RAISE EXCEPTION USING
          ERRCODE = '28000',
          MESSAGE = pg_catalog.format('fence-proxy: lockd.fence for %s is a plain token that fence-proxy did not accept: this database takes only fences a fence-proxy with --verify-key verified (signed sequencers, or plain tokens under --allow-unsigned)', pg_catalog.to_json(v_resource)::text),
          HINT = 'SET lockd.fence = ''<resource>:<sequencer>'' (a SET statement or the startup options), with the sequencer lockd returned with the lock.';
      END IF;
      RAISE EXCEPTION USING
        ERRCODE = '42501',
        MESSAGE = pg_catalog.format('fence-proxy: lockd.fence for %s was not verified by fence-proxy: a forged or altered sequencer, or a value set by a statement the proxy does not read (set_config, ALTER ROLE ... SET)', pg_catalog.to_json(v_resource)::text),
        HINT = 'SET lockd.fence = ''<resource>:<sequencer>'' (a SET statement or the startup options), with the sequencer lockd returned with the lock.';
    END IF;
  ELSE
  -- Nested checks, because SQL does not promise to evaluate OR operands in order and the cast
  -- must only see digits.
  v_bad := v_sep = 0
     OR pg_catalog.octet_length(v_resource) NOT BETWEEN 1 AND 256
     OR v_resource OPERATOR(pg_catalog.~) ('[' || pg_catalog.chr(1) || '-' || pg_catalog.chr(31) || pg_catalog.chr(127) || '-' || pg_catalog.chr(159) || ']')
     OR v_digits OPERATOR(pg_catalog.!~) '^[0-9]{{1,19}}$';
  IF NOT v_bad THEN
    v_bad := v_digits::pg_catalog.numeric > 9223372036854775807;
  END IF;
  IF v_bad THEN
    RAISE EXCEPTION USING
      ERRCODE = '22023',
      MESSAGE = pg_catalog.format('fence-proxy: invalid lockd.fence value %s: expected <resource>:<token>, the resource 1 to 256 bytes without control characters, the token decimal digits up to 9223372036854775807', pg_catalog.to_json(v_fence)::text),
      HINT = 'SET lockd.fence = ''<resource>:<token>'', with the fencing token lockd granted, e.g. ''orders:42''.';
  END IF;
  v_token := v_digits::bigint;
  END IF;
  -- Read without a lock first: two raisers of one new token must not both hold a share lock and
  -- then deadlock upgrading it.
  SELECT f.token INTO v_highest FROM {t} AS f WHERE f.resource = v_resource;
  IF FOUND AND v_highest = v_token THEN
    -- Same holder. Before a statement of the client's, a transaction that has written nothing
    -- yet has nothing to protect: the unlocked read is the early refusal, and the guard before
    -- COMMIT, which runs after every write, takes a lock. Skipping the lock here halves the
    -- row locks per transaction (each one a tuple write, and a MultiXact while other sessions
    -- of the holder hold it too), and a paused holder's open block never delays a newer one.
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
      IF NOT at_commit THEN
        RETURN;
      END IF;
      -- Before COMMIT, "no transaction id" does not mean "no effect": a NOTIFY is delivered at
      -- commit and gets its id only then. Under READ COMMITTED (and READ UNCOMMITTED, the same
      -- in Postgres) a shared advisory lock on the resource, taken before a fresh read, orders
      -- this commit before any raise (a raise takes it exclusively) without making the
      -- transaction write. Under REPEATABLE READ and SERIALIZABLE the read above saw the
      -- transaction's snapshot, which may predate a raise: the row lock below sees the latest
      -- version (or fails with 40001); a READ ONLY transaction may not lock a row, so it gets
      -- the advisory lock only, which orders it against raises still in progress.
      IF pg_catalog.current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') THEN
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext('{t}'), pg_catalog.hashtext(v_resource));
        SELECT f.token INTO v_highest FROM {t} AS f WHERE f.resource = v_resource;
        IF FOUND AND v_highest = v_token THEN
          RETURN;
        END IF;
      ELSIF pg_catalog.current_setting('transaction_read_only') = 'on' THEN
        -- The read above saw this transaction's snapshot, so a raise committed since is not
        -- seen: safe only because the transaction writes nothing. A WITH HOLD cursor's query
        -- runs during COMMIT, after this guard, and may write large objects (READ ONLY does
        -- not stop them).
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_cursors AS c WHERE c.is_holdable) THEN
          RAISE EXCEPTION USING
            ERRCODE = '0A000',
            MESSAGE = pg_catalog.format('fence-proxy: a READ ONLY transaction at %s isolation cannot commit with a WITH HOLD cursor open (%s): its query runs at COMMIT, after the guard, which cannot see a newer holder from this snapshot', pg_catalog.current_setting('transaction_isolation'), pg_catalog.quote_ident((SELECT c.name FROM pg_catalog.pg_cursors AS c WHERE c.is_holdable LIMIT 1))),
            HINT = 'CLOSE the cursor before COMMIT, or use READ COMMITTED.';
        END IF;
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtext('{t}'), pg_catalog.hashtext(v_resource));
        RETURN;
      END IF;
    END IF;
    IF FOUND AND v_highest = v_token THEN
      -- It wrote (or must be ordered by the row): a shared row lock, held to the end of the
      -- transaction, so the holder's transactions do not serialize on the row while a newer
      -- holder's raise waits for all of them to end.
      SELECT f.token INTO v_highest FROM {t} AS f WHERE f.resource = v_resource FOR SHARE;
      IF v_highest = v_token THEN
        RETURN;
      END IF;
    END IF;
  END IF;
  IF NOT FOUND OR v_highest < v_token THEN
    -- A raise waits for every commit of an older holder that holds the advisory lock above.
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('{t}'), pg_catalog.hashtext(v_resource));
    -- The floor `init --token-floor` set when this table was lost: every token below it may be
    -- older than one the lost table accepted (init raised the rows it kept to it). Read only
    -- on this path, which writes anyway.
    SELECT r.token_floor INTO v_floor FROM {guard_schema}.fence_tables AS r WHERE r.fence_table = '{t}';
    IF v_floor > v_token THEN
      v_highest := v_floor;
    ELSE
      INSERT INTO {t} AS f (resource, token, updated_at) VALUES (v_resource, v_token, pg_catalog.now())
      ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = pg_catalog.now()
      WHERE f.token <= EXCLUDED.token;
      IF FOUND THEN
        RETURN;
      END IF;
      SELECT f.token INTO v_highest FROM {t} AS f WHERE f.resource = v_resource;
    END IF;
  END IF;
  RAISE EXCEPTION USING
    ERRCODE = '55P03',
    MESSAGE = pg_catalog.format('fence-proxy: stale fencing token %s for %s: highest accepted is %s',
                     v_token, pg_catalog.to_json(v_resource)::text, v_highest),
    DETAIL = pg_catalog.format('resource=%s token=%s highest=%s', pg_catalog.to_json(v_resource)::text, v_token, v_highest),
    HINT = 'This session no longer holds the lock: nothing of this transaction was applied. Roll back, acquire the lock again and SET lockd.fence to the new token.';
END
$lockd_guard$;
REVOKE ALL ON FUNCTION {f}(boolean, text[], boolean) FROM PUBLIC;
"#,
            schema = self.schema,
            guard_schema = GUARD_SCHEMA,
            revision = GUARD_REVISION,
        )
    }

    /// `init --require-verified`: a proof key for this table, if it has none yet. 64 bytes each
    /// from SHA-256 of `gen_random_uuid()` (strong random, 122 bits a UUID).
    pub fn require_verified_sql(&self) -> String {
        let r =
            "pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.gen_random_uuid()::text, 'UTF8'))";
        format!(
            "INSERT INTO {GUARD_SCHEMA}.proof_key (fence_table, kin, kout) VALUES ('{}', {r} || {r}, {r} || {r}) ON CONFLICT (fence_table) DO NOTHING;\n",
            self.qualified()
        )
    }

    /// What the proxy reads at start: this table's proof key, if verified fences are required.
    pub fn proof_key_sql(&self) -> String {
        format!(
            "SELECT kin, kout FROM {GUARD_SCHEMA}.proof_key WHERE fence_table = '{}'",
            self.qualified()
        )
    }

    /// Whether verified fences are required for this table, without reading its proof key: what
    /// a proxy without `--verify-key` asks, so that the key never travels to a proxy that has no
    /// use for it (and whose upstream connection need not be checked TLS).
    pub fn proof_key_exists_sql(&self) -> String {
        format!(
            "SELECT EXISTS (SELECT 1 FROM {GUARD_SCHEMA}.proof_key WHERE fence_table = '{}')",
            self.qualified()
        )
    }

    /// Statements that let the proxy's `--upstream` role read the proof keys.
    pub fn grant_proof_key_sql(role: &str) -> String {
        let role = quote_ident(role);
        format!(
            "GRANT USAGE ON SCHEMA {GUARD_SCHEMA} TO {role};\nGRANT SELECT ON {GUARD_SCHEMA}.proof_key TO {role};\n"
        )
    }

    /// The statements that let `role` use the guard: USAGE on the guard's schema and EXECUTE on
    /// the function, and nothing on the table.
    pub fn grant_sql(&self, role: &str) -> String {
        let role = quote_ident(role);
        format!(
            "GRANT USAGE ON SCHEMA {GUARD_SCHEMA} TO {role};\nGRANT EXECUTE ON FUNCTION {}(boolean, text[], boolean) TO {role};\n",
            self.guard_function()
        )
    }
}

/// Quotes an identifier for SQL (a role name given on the command line).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A line of the guard's body that names its revision; a proxy with `--verify-key` refuses to
/// start on a guard whose revision is below [`GUARD_REVISION_NUMBER`] or that has no such line
/// (an older `init`'s guard takes plain tokens from a table whose proof key is gone, see the
/// guard). It is [`GUARD_REVISION_PREFIX`], the number, and a colon.
pub const GUARD_REVISION: &str = "fence-proxy guard revision 5: proofs need a proof key";

/// What precedes the number in [`GUARD_REVISION`]; the proxy reads the number after it.
pub const GUARD_REVISION_PREFIX: &str = "fence-proxy guard revision ";

/// The revision of the guard this proxy needs under `--verify-key`, the number in
/// [`GUARD_REVISION`]. A later revision of the guard keeps what this one promises.
pub const GUARD_REVISION_NUMBER: u32 = 5;

/// The largest token the `bigint` column holds.
pub const MAX_RECORDABLE_TOKEN: u64 = i64::MAX as u64;

/// Whether the session has no fence, in a form the client's `search_path` cannot change (see
/// [`FenceTable::guard_call`]).
const UNFENCED_EXPR: &str =
    "COALESCE(pg_catalog.current_setting('lockd.fence', true), '') OPERATOR(pg_catalog.=) ''";

/// The `pg_database.oid` of the connected database, `NULL` if it has none (never). The name is
/// compared with `OPERATOR(pg_catalog.=)`: a client's `search_path` may put a schema with an
/// `=` of its own for `name` ahead of `pg_catalog`, which could pick another database's row.
const DATABASE_OID_EXPR: &str = "(SELECT d.oid FROM pg_catalog.pg_database d \
     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())";

/// What the start-up check asks first: the connected database's name and oid (as `int8`), the
/// oid being what each session's first query compares (see [`session_start_sql`]).
pub const CHECKED_DATABASE_SQL: &str = "SELECT pg_catalog.current_database()::pg_catalog.text, \
     (SELECT d.oid::pg_catalog.int8 FROM pg_catalog.pg_database d \
     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())";

/// What the proxy asks once when a session starts, before anything of the client's goes
/// upstream. The third column is the oid of the database the session is in: the proxy checked a
/// database of that name at start, and refuses the session unless it is the same one (a clone
/// renamed into the name would take tokens its original refused). Without `--require-fence`
/// the second column says whether the session has a fence from its startup options or its
/// role's and database's defaults, like a guard call's answer: a fence seen there keeps every
/// opening guard of the session. Under `--require-fence` it is NULL and not read.
pub fn session_start_sql(require_fence: bool) -> String {
    let unfenced = if require_fence { "NULL" } else { UNFENCED_EXPR };
    format!("SELECT NULL, {unfenced}, {DATABASE_OID_EXPR}")
}

// The proxy's own transaction statements, sent where the client's statements need a block.
/// Opens the proxy's own transaction block.
pub const BEGIN_SQL: &str = "BEGIN";
/// Commits the proxy's own transaction block.
pub const COMMIT_SQL: &str = "COMMIT";
/// Rolls back the proxy's own transaction block.
pub const ROLLBACK_SQL: &str = "ROLLBACK";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers_and_qualified() {
        assert_eq!(
            FenceTable::parse("lockd_fence").unwrap().qualified(),
            "public.lockd_fence"
        );
        let t = FenceTable::parse("ops.fences").unwrap();
        assert_eq!(t.guard_function(), "lockd_fence_proxy.ops__fences_guard");
        assert_eq!(
            t.guard_call(true, None, false),
            "SELECT lockd_fence_proxy.ops__fences_guard(true, NULL, false)"
        );
        assert_eq!(
            t.guard_call(false, None, true),
            "SELECT lockd_fence_proxy.ops__fences_guard(false, NULL, true), \
             COALESCE(pg_catalog.current_setting('lockd.fence', true), '') OPERATOR(pg_catalog.=) ''"
        );
        assert_eq!(
            FenceTable::parse("lockd_fence").unwrap().guard_function(),
            "lockd_fence_proxy.lockd_fence_guard"
        );
        for bad in [
            "",
            "a.b.c",
            "x;drop",
            "Upper",
            "1abc",
            "a b",
            "pg_temp.x",
            "a.",
            "lockd_fence_proxy.x",
        ] {
            assert!(FenceTable::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// The revision line says the number the proxy looks for, after the prefix it looks after.
    #[test]
    fn the_revision_line_carries_the_number() {
        assert!(
            GUARD_REVISION.starts_with(&format!("{GUARD_REVISION_PREFIX}{GUARD_REVISION_NUMBER}:")),
            "{GUARD_REVISION}"
        );
        let sql = FenceTable::parse("lockd_fence").unwrap().revision_sql();
        assert!(sql.contains(GUARD_REVISION_PREFIX), "{sql}");
    }

    #[test]
    fn init_sql_has_no_backslash_and_grants_nothing_on_the_table() {
        let t = FenceTable::parse("public.lockd_fence").unwrap();
        let sql = t.init_sql(None);
        assert!(!sql.contains('\\'));
        assert!(sql.contains("REVOKE ALL ON TABLE public.lockd_fence FROM PUBLIC"));
        let g = t.grant_sql("app\"x");
        assert!(g.contains("\"app\"\"x\""), "{g}");
        assert!(!g.contains("ON TABLE"), "{g}");
    }
}
