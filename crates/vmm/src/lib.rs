//! VMM (to be written).
