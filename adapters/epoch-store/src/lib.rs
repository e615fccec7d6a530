//! fence-epoch-store (work in progress).
