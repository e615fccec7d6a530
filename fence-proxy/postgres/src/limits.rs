//! Every bound the front end enforces, kept together with its reason.

/// Longest startup packet (SSLRequest, CancelRequest or StartupMessage) accepted from a client.
/// Postgres itself refuses startup packets above 10,000 bytes (`MAX_STARTUP_PACKET_LENGTH`), so a
/// longer one can never be valid.
pub const MAX_STARTUP_PACKET_BYTES: usize = 10_000;

/// Default bound on one protocol message body, in either direction. It caps the memory a session
/// holds for one message (the relay buffers whole messages, growing the buffer as bytes arrive,
/// never reserving a declared length up front); 64 MiB leaves room for large `bytea`
/// values and COPY rows. Sessions times this is what authenticated clients could make the proxy
/// hold at once, so size it with `--max-sessions` for the host (docs: "Threat model"); Postgres's
/// own ceiling is 1 GiB per backend. Before authentication the bound is
/// [`MAX_AUTH_MESSAGE_BYTES`].
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// How many SSLRequest/GSSENCRequest refusals a client gets before it must send its startup
/// message; libpq sends at most one of each, so a third one means a confused or hostile client.
pub const MAX_ENCRYPTION_REQUESTS: usize = 2;

/// Largest `--max-sessions` and `--max-startups-per-client`: far above what one process serves,
/// and below what a semaphore holds.
pub const PLACES_MAX: usize = 1_000_000;

/// Prepared statements (and, separately, portals) whose kind the proxy remembers per session.
/// Only transaction-control and setting statements are remembered (every other statement is
/// ordinary by default), so real clients stay far below this; it bounds a hostile client.
pub const MAX_TRACKED_NAMES: usize = 1_000;

/// Longest prepared statement or portal name accepted. Drivers generate names of a few dozen
/// bytes (`s0`, `sqlx_s_1`, `stmtcache_<hash>`); with [`MAX_TRACKED_NAMES`] this keeps the name
/// maps of one session under about 2 MiB.
pub const MAX_NAME_BYTES: usize = 1_024;

/// Responses the proxy may be waiting for before it stops reading the client (a client that
/// pipelines messages without reading answers). Each costs a few dozen bytes.
pub const MAX_PENDING_UNITS: usize = 10_000;

/// Longest SQL text (one Query or Parse) the proxy classifies. Postgres's parser and pg_query's
/// protobuf encoding of the tree (decoded again by prost) cost several hundred bytes of memory
/// per byte of SQL (a 1 MB `SELECT 1,1,...` raised the proxy's peak by over 600 MiB), so this
/// bound, not `--max-message-bytes`, is what keeps one query from exhausting the proxy: 128 KiB
/// costs at most about 100 MiB for the moment of classification. Larger data belongs in
/// parameters (Bind values are not parsed) or COPY, which carry any size.
pub const MAX_CLASSIFIED_SQL_BYTES: usize = 128 * 1024;

/// Stack of the threads that parse texts longer than [`POOLED_PARSE_SQL_BYTES`]. pg_query turns
/// the parse tree into protobuf recursively in C without a depth check; the deepest tree a text
/// of [`MAX_CLASSIFIED_SQL_BYTES`] can produce is a left-deep `1+1+...` of one level per two
/// bytes (about 65,000 levels), which needs far less than this. The stack is reserved, not
/// touched, so it costs address space, not memory.
pub const CLASSIFY_STACK_BYTES: usize = 512 * 1024 * 1024;

/// Query texts up to this size are parsed on the session thread itself (most statements are
/// shorter); see `parser`. Parse time grows with the square of some texts' length (Postgres's
/// lexer rescans a run of operator characters): the worst 1 KiB measured took 4.5 ms, so the
/// bound is half that, about a quarter of the time, and a session yields after a slow parse.
pub const INLINE_PARSE_SQL_BYTES: usize = 512;

/// Stack of a session thread. The deepest tree a text of [`INLINE_PARSE_SQL_BYTES`] holds (a
/// unary chain, `SELECT -+-+...1`, one level per byte) needs well under a MiB in a debug build;
/// this leaves the session's own frames and a wide margin.
pub const SESSION_THREAD_STACK_BYTES: usize = 16 * 1024 * 1024;

/// Longer query texts, up to this size, are parsed by the proxy's long-lived parser threads;
/// longer ones still (up to [`MAX_CLASSIFIED_SQL_BYTES`]) by a few threads of their own, so that
/// slow parses of long texts never hold up the short ones everyone sends.
pub const POOLED_PARSE_SQL_BYTES: usize = 8 * 1024;

/// Most threads that parse texts longer than [`POOLED_PARSE_SQL_BYTES`] at once (one per two
/// CPUs, at least two). Such a parse holds up to about 100 MiB at [`MAX_CLASSIFIED_SQL_BYTES`]
/// and can take seconds (see `parser`), so this bounds what all sessions' long texts together
/// cost the proxy: about 400 MiB and four threads' CPU. Longer texts queue for them in order.
pub const LONG_PARSE_THREADS_MAX: usize = 4;

/// Stack of a pooled parser thread. The deepest tree a text of [`POOLED_PARSE_SQL_BYTES`] holds
/// (a unary chain, about 8,000 levels) fits in a few MiB in a debug build (`parser::tests`);
/// this leaves a wide margin.
pub const POOLED_PARSER_STACK_BYTES: usize = 32 * 1024 * 1024;

/// Statements of one simple-query message the proxy classifies. Scripts sent in one message
/// (psql -c, migrations) rarely have more than a few hundred; the bound keeps the classification
/// vector small. (The parse tree itself is bounded by `--max-message-bytes`.)
pub const MAX_STATEMENTS_PER_QUERY: usize = 100_000;

/// Most opening guards the proxy splices into one simple Query (one before the first data
/// statement, and one after each ROLLBACK TO or SET of `lockd.fence` that a data statement
/// follows): each is a guard call and some hundred bytes of text, so a query of short
/// `RESET ALL; SELECT;` pairs would otherwise grow some fifty-fold upstream.
pub const MAX_GUARDS_PER_QUERY: usize = 64;

/// Default bound on connections from one client address in startup and authentication at once
/// (`--max-startups-per-client`). Startup takes a few round trips, so even a pool that opens
/// many connections at once has few in startup at any moment; a client that opens connections
/// and sends nothing holds each for the whole `--startup-timeout`.
pub const DEFAULT_MAX_STARTUPS_PER_CLIENT: usize = 64;

/// Longest message body a client may send before it is authenticated: its password, SASL or
/// GSSAPI answer. Postgres refuses longer ones too (`PG_MAX_AUTH_TOKEN_LENGTH`, 65,535 bytes),
/// and until authentication succeeds nothing but this bound stops a client from making the proxy
/// buffer a message of `--max-message-bytes`.
pub const MAX_AUTH_MESSAGE_BYTES: usize = 65_535;

/// Refusals (outside `--allow-client`, too many sessions or startups) whose error is being
/// written at once; each lives up to two seconds. Past it a refused connection is closed without
/// its error, so a flood of refused connections cannot run the proxy out of descriptors.
pub const REFUSALS_IN_FLIGHT_MAX: usize = 256;

/// Default number of concurrent client sessions. Each session holds one upstream connection, so
/// this also bounds the proxy's share of the upstream's `max_connections`.
pub const DEFAULT_MAX_SESSIONS: usize = 1_000;

/// How long a session may take to end once the proxy is told to stop (SIGTERM). A session
/// normally ends at once (FATAL 57P01 to its client); one blocked writing to a client that stopped
/// reading does not see the shutdown, and without a bound it kept the proxy running for as long
/// as that client stayed connected. After the grace the session is dropped: both connections
/// close, and the upstream rolls back whatever transaction was open.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
