//! Engine against reference on every fixture, on every CPU backend this machine has: the same
//! tokens (teacher-forced), every tap of docs/TAPS.md compared in forward order with `harness`'s
//! tolerance policy, and the first tap past tolerance named in the failure. `cargo xtask verify`
//! runs the same comparison as a matrix with gates and reports; this is its test-suite twin.

use engine::exec::{Engine, Session};
use engine::model::Model;
use engine::runtime::CpuBackend;
use engine::taps::TapRecorder;
use harness::cases::split_fixture_name;
use harness::tap::Tap;
use harness::tolerance::{CaseContext, TolerancePolicy};
use kernels::cpu::Isa;
use reference::{Precision, ReferenceModel};

fn check(spec: &golden::fixtures::FixtureSpec) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = golden::fixtures::write(spec, dir.path()).expect("fixture written");
    let tokens = golden::vocab::sample_tokens();

    let reference =
        ReferenceModel::load(&path, Precision::F32).expect("reference loads the fixture");
    let mut ref_taps = Vec::new();
    let ref_logits = reference
        .forward(&tokens, &mut |n, s, d| {
            ref_taps.push(Tap::new(n, s.to_vec(), d.to_vec()))
        })
        .expect("reference forward");

    let model = Model::load(&path).expect("engine loads the fixture");
    for isa in Isa::available() {
        let backend = CpuBackend::new(Some(isa), Some(2)).expect("backend");
        let mut recorder = TapRecorder::new();
        let engine = Engine::new(&model, &backend).expect("weights prepare");
        let mut session = Session::new(&engine, tokens.len()).expect("session");
        session.set_logits_all(true);
        let logits = session
            .forward(&tokens, Some(&mut recorder))
            .expect("engine forward");
        let eng_taps: Vec<Tap> = recorder
            .taps
            .into_iter()
            .map(|t| Tap::new(t.name, t.shape, t.data))
            .collect();
        let ctx = CaseContext::new(
            split_fixture_name(spec.name)
                .map(|(_, w)| w)
                .expect("fixture name ends in its weights"),
            &format!("cpu-{}", isa.name()),
        )
        .expect("context");
        let cmp =
            harness::compare::compare_taps(&eng_taps, &ref_taps, &TolerancePolicy::default(), &ctx);
        assert!(
            cmp.first_divergence.is_none(),
            "{} on cpu-{}: first divergence {:?}",
            spec.name,
            isa.name(),
            cmp.first_divergence.as_ref().map(|d| d.finding.to_string())
        );
        assert_eq!(
            cmp.taps.len(),
            ref_taps.len(),
            "{}: every reference tap compared",
            spec.name
        );
        assert_eq!(logits.data.len(), ref_logits.len());
    }
}

#[test]
fn engine_matches_reference_on_every_fixture() {
    let specs = golden::fixtures::all();
    assert!(specs.len() >= 8, "every architecture has fixtures");
    for spec in &specs {
        check(spec);
    }
}
