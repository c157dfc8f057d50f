//! Engine (to be written).
