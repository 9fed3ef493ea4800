//! The device suite ([`crate::suite`]) on a real GPU, device 0. This `gpu` module is excluded
//! from the default nextest profile; the `gpu` profile runs it one test at a time, and each test
//! FAILS when no device can be opened or the real model is missing (a GPU runner without a
//! usable GPU must not report green).

use engine::model::Model;
use engine::runtime::cuda::CudaBackend;

fn device() -> Option<CudaBackend> {
    Some(CudaBackend::open(0).unwrap_or_else(|e| panic!("the gpu tests need a CUDA device: {e}")))
}

fn model() -> Option<Model> {
    let path = crate::suite::real_model_path();
    Some(
        Model::load(&path)
            .unwrap_or_else(|e| panic!("the gpu model test needs {}: {e}", path.display())),
    )
}

crate::suite::backend_ops_tests!(device(), model(), 8);
crate::suite::cuda_tests!(device());
