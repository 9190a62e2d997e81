//! smc (being built).
