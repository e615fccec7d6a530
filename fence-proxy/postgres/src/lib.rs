//! fence-proxy-postgres (work in progress).
