//! sparkd serving library.
