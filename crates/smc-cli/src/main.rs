//! `smc`: the smc-rs command line.
#![forbid(unsafe_code)]

mod decode;
mod demo;
mod nc;

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
    /// The server process of `smc demo`.
    #[command(hide = true)]
    DemoServer(demo::DemoServerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Decode(args) => decode::run(&args),
        Command::Nc(args) => nc::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::DemoServer(args) => demo::run_server(&args),
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
