//! The library's threads start before the call that made them returns.
//!
//! glibc counts a thread as "being created" from its `clone` until the new thread first
//! runs (its `setxid_futex` is -1 meanwhile), and `setuid`, `setgroups` and the other
//! credential calls of a multithreaded process wait until every thread it counts has started.
//! A program that copies itself by a raw `clone` system call (vsftpd's session processes)
//! copies that count but not the threads, which do not exist in the copy: had a thread of
//! ours been in its first instant at the copy, the copy's next `setgroups` waited for it
//! forever (seen: vsftpd's login process hung after the listener's first accept had started
//! the settler thread an instant before the clone). So every thread started on a program's
//! call is running when the call returns to the program.

use std::io;
use std::thread::{Builder, JoinHandle};

/// Spawn `f` as `builder` says and return once the new thread runs.
pub fn spawn_running<F, T>(builder: Builder, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // The new thread inherits the caller's policy: not a bulk read's kept `SCHED_BATCH`.
    crate::QuietWake::settle();
    let (started, running) = std::sync::mpsc::sync_channel::<()>(1);
    let h = builder.spawn(move || {
        let _ = started.send(());
        f()
    })?;
    // The thread always sends first (a failed receive: it ended without running `f`).
    let _ = running.recv();
    Ok(h)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_thread_runs_when_spawn_running_returns() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let ran = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(std::sync::Barrier::new(2));
        let (r, g) = (ran.clone(), gate.clone());
        let h = super::spawn_running(std::thread::Builder::new().name("t".into()), move || {
            // The spawner returns while this thread waits here: it started first.
            r.store(true, Ordering::SeqCst);
            g.wait();
            7
        })
        .unwrap();
        gate.wait();
        assert!(ran.load(Ordering::SeqCst));
        assert_eq!(h.join().unwrap(), 7);
    }
}
