//! lockd-core (work in progress).
