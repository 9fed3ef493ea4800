//! Topology cost model (step 5).
