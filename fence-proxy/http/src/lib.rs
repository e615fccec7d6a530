//! fence-proxy-http (work in progress).
