//! `smc ueid`: the UEIDs and versions from the environment; a malformed UEID is an error
//! that names it.
#![allow(missing_docs)]

use std::process::Command;

fn smc_ueid(env: &[(&str, &str)], json: bool) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smc"));
    c.arg("ueid")
        .env_remove("SMC_UEIDS")
        .env_remove("SMC_VERSIONS")
        .env_remove("SMC_CONFIG");
    if json {
        c.arg("--json");
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run smc ueid")
}

#[test]
fn lists_the_configured_ueids() {
    let o = smc_ueid(&[("SMC_UEIDS", "KERNEL-PEER-SMCR-TEST, SMC.RS-2")], false);
    assert!(o.status.success());
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "KERNEL-PEER-SMCR-TEST\nSMC.RS-2\n"
    );
    let o = smc_ueid(&[("SMC_UEIDS", "A"), ("SMC_VERSIONS", "2")], true);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["ueids"][0]["ueid"], "A");
    assert_eq!(
        v["ueids"][0]["bytes"],
        format!("41{}", "20".repeat(31)),
        "blank-padded to 32 bytes"
    );
    assert_eq!(v["versions"], serde_json::json!([2]));
    assert_eq!(v["smc_rv2"], true);
    let o = smc_ueid(&[], true);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["smc_rv2"], false);
    assert_eq!(v["versions"], serde_json::json!([1, 2]));
}

#[test]
fn a_malformed_ueid_is_named() {
    for bad in ["lower", "A..B", "-X", "TOO-LONG-TOO-LONG-TOO-LONG-TOO-LONG"] {
        let o = smc_ueid(&[("SMC_UEIDS", &format!("GOOD,{bad}"))], false);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
    }
    let o = smc_ueid(&[("SMC_VERSIONS", "3")], false);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("SMC_VERSIONS"));
}
