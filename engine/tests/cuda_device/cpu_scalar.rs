//! The backend-ops suite ([`crate::suite`]) on the CPU backend with the scalar kernels, against
//! the CPU backend with the best ISA of this machine: the scalar twins are the first oracle of
//! the SIMD kernels, and the suite's bounds hold between them too. (On a machine whose best ISA
//! is scalar both sides run the same kernels.)

use engine::model::Model;
use engine::runtime::CpuBackend;
use kernels::cpu::Isa;

fn device() -> Option<CpuBackend> {
    Some(CpuBackend::new(Some(Isa::Scalar), Some(2)).unwrap_or_else(|e| panic!("{e}")))
}

// The real model through the scalar kernels is the CPU backend's own test (engine/tests); not
// repeated here.
fn model() -> Option<Model> {
    None
}

crate::suite::backend_ops_tests!(device(), model(), 0);
