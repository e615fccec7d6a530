//! lockd-client (work in progress).
