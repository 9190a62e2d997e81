//! smc-fabric (being built).
