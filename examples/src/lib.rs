//! Small programs that show how to extend lockd's fencing; run them with
//! `cargo run -p lockd-examples --example <name>`.
//!
//! This library holds no code of its own: the programs are under `examples/examples/`.
//!
//! # Layout
//! - `custom_epoch_store`: an epoch store of one's own (in memory), plugged into the HTTP front end
//!   of fence-proxy with `fence_proxy_http::serve`.
