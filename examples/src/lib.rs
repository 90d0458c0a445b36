//! Example driver scripts live under `examples/`; see each file.
