//! Backup and restore: the backup file a leader streams (`Cluster.SaveSnapshot`, written by
//! `lockctl snapshot save`), and `lockd restore`, which seeds a new cluster's node from one with
//! a token floor.
//!
//! # Layout
//! - [`mod@file`]: the file format (header, table, end marker, length, SHA-256) and its verification.
//! - [`restore`]: `lockd restore`: refuses without a floor decision or into a used data dir,
//!   raises the token counter, writes `snapshot.bin` and the log records.

pub mod file;
pub mod restore;
