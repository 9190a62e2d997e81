//! `smc ueid`: the SMC-Rv2 UEIDs (and SMC versions) a stack started with this environment uses
//! (`SMC_UEIDS`, `SMC_VERSIONS`, or the TOML file of `SMC_CONFIG`).

use std::process::ExitCode;

use anyhow::Result;
use serde_json::json;
use smc::StackConfig;

/// Arguments of `smc ueid`.
#[derive(clap::Args, Debug)]
pub struct UeidArgs {
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Run `smc ueid`.
pub fn run(args: &UeidArgs) -> Result<ExitCode> {
    let config = match StackConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("smc ueid: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let mut versions = Vec::new();
    if config.versions.v1 {
        versions.push(1);
    }
    if config.versions.v2 {
        versions.push(2);
    }
    let v2_possible = config.versions.v2 && !config.ueids.is_empty();
    if args.json {
        let ueids: Vec<_> = config
            .ueids
            .iter()
            .map(|e| json!({"ueid": e.text(), "bytes": hex::encode(e.0)}))
            .collect();
        println!(
            "{}",
            json!({"ueids": ueids, "versions": versions, "smc_rv2": v2_possible})
        );
    } else {
        if config.ueids.is_empty() {
            println!("no UEID configured (SMC_UEIDS): SMC-Rv2 is neither offered nor accepted");
        }
        for e in &config.ueids {
            println!("{}", e.text());
        }
        let v: Vec<String> = versions.iter().map(u8::to_string).collect();
        eprintln!(
            "versions {} (SMC_VERSIONS); SMC-Rv2 {}",
            v.join(","),
            if v2_possible { "possible" } else { "off" }
        );
    }
    Ok(ExitCode::SUCCESS)
}
