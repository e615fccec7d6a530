//! lockd-examples (work in progress).
