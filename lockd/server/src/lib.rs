//! lockd-server (work in progress).
