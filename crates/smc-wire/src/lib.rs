//! smc-wire (being built).
