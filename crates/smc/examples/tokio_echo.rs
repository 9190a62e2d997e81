//! A plain tokio echo server and client (`tokio::net`, no smc-rs API): a program for
//! `smc run`, checked by `scripts/preload-apps.sh`.
//!
//! ```text
//! tokio_echo server PORT CONNS        # echo CONNS connections, then exit
//! tokio_echo client PORT CONNS BYTES  # CONNS concurrent connections, BYTES each way
//! ```
//!
//! The server echoes each connection until the client's end of stream, then shuts its
//! writing down. Each client connection writes BYTES (a pattern of its own) from one task
//! while another reads the echo, shuts writing down and reads to the end of stream; the
//! SHA-256 of what came back must be the one of what was sent. Both exit 1 on a mismatch,
//! an error, or after 60 s without finishing.
#![allow(missing_docs)]

use std::process::ExitCode;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LIMIT: Duration = Duration::from_secs(60);

fn usage() -> ExitCode {
    eprintln!("usage: tokio_echo server PORT CONNS | client PORT CONNS BYTES");
    ExitCode::from(2)
}

fn pattern(conn: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 13) as u8 ^ conn as u8)
        .collect()
}

async fn serve(port: u16, conns: usize) -> std::io::Result<u64> {
    let l = TcpListener::bind(("127.0.0.1", port)).await?;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (mut s, _) = l.accept().await?;
        tasks.push(tokio::spawn(async move {
            let (mut r, mut w) = s.split();
            let n = tokio::io::copy(&mut r, &mut w).await?;
            w.shutdown().await?;
            Ok::<u64, std::io::Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(std::io::Error::other)??;
    }
    Ok(total)
}

async fn one_client(port: u16, conn: usize, len: usize) -> std::io::Result<()> {
    let s = TcpStream::connect(("127.0.0.1", port)).await?;
    let (mut r, mut w) = s.into_split();
    let data = pattern(conn, len);
    let want = Sha256::digest(&data);
    let writer = tokio::spawn(async move {
        w.write_all(&data).await?;
        w.shutdown().await?;
        Ok::<_, std::io::Error>(w)
    });
    let mut hash = Sha256::new();
    let mut got = 0usize;
    let mut buf = vec![0u8; 65536];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        got += n;
    }
    let _w = writer.await.map_err(std::io::Error::other)??;
    if got != len || hash.finalize() != want {
        return Err(std::io::Error::other(format!(
            "connection {conn}: {got} of {len} bytes back, or a different SHA-256"
        )));
    }
    Ok(())
}

async fn clients(port: u16, conns: usize, len: usize) -> std::io::Result<()> {
    let tasks: Vec<_> = (0..conns)
        .map(|i| tokio::spawn(one_client(port, i, len)))
        .collect();
    for t in tasks {
        t.await.map_err(std::io::Error::other)??;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| args.get(i).and_then(|a| a.parse::<usize>().ok());
    let (Some(port), Some(conns)) = (num(1).and_then(|p| u16::try_from(p).ok()), num(2)) else {
        return usage();
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio_echo: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match args.first().map(String::as_str) {
        Some("server") => rt
            .block_on(async { tokio::time::timeout(LIMIT, serve(port, conns)).await })
            .map(|r| {
                r.map(|n| println!("tokio_echo server: {conns} connections, {n} bytes echoed"))
            }),
        Some("client") => {
            let Some(len) = num(3) else {
                return usage();
            };
            rt.block_on(async { tokio::time::timeout(LIMIT, clients(port, conns, len)).await })
                .map(|r| {
                    r.map(|()| {
                        println!("tokio_echo client: {conns} connections, {len} bytes each, echoes right")
                    })
                })
        }
        _ => return usage(),
    };
    match r {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("tokio_echo: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("tokio_echo: not done after {LIMIT:?}");
            ExitCode::FAILURE
        }
    }
}
