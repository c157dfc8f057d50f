//! Guest image (to be written).
