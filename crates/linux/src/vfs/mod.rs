//! Virtual file system (to be written).
