//! Cross-crate: a resolved plan feeds the metrics snapshot, host memory comes from the Linux
//! probe, and the Platform value swaps one adapter at a time.

use std::sync::Arc;

use ddo_core::{
    Admission, AdmissionProbe, GrowthKind, GrowthRequest, HostMemoryObservation,
    MockAdmissionProbe, MockFence, MockResidency, Platform, Refusal, RefusalReason,
};
use ddo_metrics::{DynamicOffloadMetrics, ExecutionSection, HostMemorySection};
use ddo_platform::LinuxAdmissionProbe;
use ddo_policy::{Environment, Request, SETTING_KEYS, resolve};

#[test]
fn a_plan_becomes_the_configuration_section() {
    let request = Request {
        component: "transformer",
        environment: Environment::from_pairs([("DDO_BACKEND", "vmm")]),
        ..Request::default()
    };
    let plan = resolve(&request).unwrap();
    let mut m = DynamicOffloadMetrics::new(ExecutionSection {
        route: plan.route.name().into(),
        component: Some(plan.component.clone()),
        ..ExecutionSection::default()
    });
    m.configuration = plan.configuration();
    m.host_memory = Some(HostMemorySection {
        observation: LinuxAdmissionProbe::system().observe(),
        phase: None,
    });
    m.validate().unwrap();
    let json = m.as_dict();
    for (field, _) in SETTING_KEYS {
        assert!(json["configuration"].get(format!("dynamic_offload_{field}")).is_some(), "{field}");
    }
    assert_eq!(json["configuration"]["dynamic_offload_route"], "vmm_fast_runtime");
    assert_eq!(json["configuration"]["dynamic_offload_effective_preset"], "vmm_fast");
    assert!(
        m.format_profile()
            .contains("route=dynamic_offload runtime=vmm_fast_runtime component=transformer")
    );
}

fn refusing_probe() -> MockAdmissionProbe {
    let mut probe = MockAdmissionProbe::new();
    probe.expect_admit().returning(|r| {
        Admission::Refused(Refusal {
            request: *r,
            reason: RefusalReason::ObservationUnavailable {
                what: "test".into(),
                error: "injected".into(),
            },
        })
    });
    probe.expect_observe().returning(HostMemoryObservation::default);
    probe
}

#[test]
fn a_platform_swaps_one_adapter() {
    let base = Platform {
        name: "mock",
        residency: Arc::new(MockResidency::new()),
        fences: Arc::new(MockFence::new()),
        admission: Arc::new(LinuxAdmissionProbe::system()),
    };
    let swapped = Platform { admission: Arc::new(refusing_probe()), ..base.clone() };
    assert!(Arc::ptr_eq(&base.residency, &swapped.residency));
    let request = GrowthRequest { kind: GrowthKind::Retained, bytes: 1, registered_bytes: 0 };
    assert!(matches!(swapped.admission.admit(&request), Admission::Refused(_)));
    assert!(matches!(base.admission.admit(&request), Admission::Granted { .. }));
}
