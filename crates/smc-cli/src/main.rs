//! `smc`: the smc-rs command line.
// No unsafe code but in `bench_floor` (the shared ring of the bench's floor measurements).
#![deny(unsafe_code)]

mod bench;
mod bench_floor;
mod bench_plot;
mod bench_report;
mod bench_server;
mod decode;
mod demo;
mod nc;
mod observe;
mod roce_floor;
mod roce_netns;
mod run;
mod ueid;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// smc-rs: SMC-R (RFC 7609) in userspace.
#[derive(Parser, Debug)]
#[command(name = "smc", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Decode SMC-R messages from hex, a pcap/pcapng file or the bundled reference vectors.
    Decode(decode::DecodeArgs),
    /// Netcat over smc-rs: `smc nc -l PORT [--echo]` or `smc nc HOST PORT`.
    Nc(nc::NcArgs),
    /// Two processes on the shm fabric: link group, transfer with a link failure, checksum,
    /// throughput next to TCP loopback.
    Demo(demo::DemoArgs),
    /// Sockets of every running stack: mode (SMC-R or TCP and why), state, link, bytes.
    Ss(observe::ObserveArgs),
    /// Link groups and their links of every running stack.
    Linkgroup(observe::ObserveArgs),
    /// Devices (RNICs) of every running stack.
    Device(observe::ObserveArgs),
    /// Counters of every running stack, fallbacks by reason included.
    Stats(observe::ObserveArgs),
    /// The PNET table of every running stack: which devices serve which interfaces.
    Pnet(observe::ObserveArgs),
    /// The SMC-Rv2 UEIDs in use (SMC_UEIDS or the TOML `ueids`) and the SMC versions.
    Ueid(ueid::UeidArgs),
    /// SMC-R against TCP loopback and Unix sockets: throughput, latency, setup rate, many
    /// streams, CPU per GB, memory per idle connection, fallback; table, JSON lines, plot.
    Bench(bench::BenchArgs),
    /// Run an unmodified program over SMC-R: `smc run [--] CMD [ARGS...]` preloads smc-rs's
    /// socket library (its TCP connections to peers that run smc-rs too use SMC-R).
    Run(run::RunArgs),
    /// The server process of `smc bench`.
    #[command(hide = true)]
    BenchServer(bench::BenchServerArgs),
    /// The server process of `smc demo`.
    #[command(hide = true)]
    DemoServer(demo::DemoServerArgs),
    /// The floor of `smc bench --fabric roce`: a software RoCE stream's per-byte work alone.
    #[command(hide = true)]
    RoceFloor(roce_floor::FloorArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Decode(args) => decode::run(&args),
        Command::Nc(args) => nc::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Ss(args) => observe::run(observe::Query::Ss, &args),
        Command::Linkgroup(args) => observe::run(observe::Query::LinkGroup, &args),
        Command::Device(args) => observe::run(observe::Query::Device, &args),
        Command::Stats(args) => observe::run(observe::Query::Stats, &args),
        Command::Pnet(args) => observe::run(observe::Query::Pnet, &args),
        Command::Ueid(args) => ueid::run(&args),
        Command::DemoServer(args) => demo::run_server(&args),
        Command::Run(args) => run::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::BenchServer(args) => bench_server::run_server(&args),
        Command::RoceFloor(args) => roce_floor::run(&args),
    };
    match result {
        Ok(code) => code,
        // A closed stdout (`smc decode ... | head`) ends the output quietly, as in other tools.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("smc: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
