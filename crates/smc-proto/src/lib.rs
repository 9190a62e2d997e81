//! smc-proto (being built).
