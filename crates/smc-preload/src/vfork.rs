//! `vfork`: before a child borrows this process's memory to exec another program (Python's
//! `subprocess` with a connection as the new program's standard input), this process starts
//! its relay server when it holds SMC-R connections, as a `fork()` would have (`relay.rs`):
//! the exec in the child names it as the connections' owner, and the new program asks it
//! for a relay. Nothing can be done in the child: it shares this process's memory, but not
//! its descriptors, and a server it bound would be its own.
//!
//! `vfork` returns twice on one stack, so no Rust frame may stand between the caller and the
//! C library's `vfork`: the entry point is a few instructions of assembly (a naked function)
//! that calls [`vfork_prepare`] and then jumps to the address it returns — the C library's
//! `vfork`, which so returns straight to the caller, in both processes.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{guard, relay, table};

/// The C library's `vfork` (0: not looked up yet).
static REAL: AtomicUsize = AtomicUsize::new(0);

/// Before the C library's `vfork`, in the calling process: serve relays when it holds
/// connections. Returns the address of the C library's `vfork` (its `fork` if that cannot be
/// found: a copy of the memory instead of a borrowed one, which a `vfork` caller accepts).
extern "C" fn vfork_prepare() -> usize {
    smc_fabric::QuietWake::settle();
    if !table::borrowed_memory() {
        // A pending client handshake ends first: the new program would get its socket in
        // the middle of it (and not named as a connection to ask the owner for).
        guard((), crate::connecting::finish_all);
        guard((), relay::serve_spawned);
    }
    let mut p = REAL.load(Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name; RTLD_NEXT finds the C library's definition.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"vfork".as_ptr()) } as usize;
        if p == 0 {
            p = libc::fork as *const () as usize;
        }
        REAL.store(p, Ordering::Relaxed);
    }
    p
}

/// x86-64: rsp is 8 past a 16-byte boundary at entry (the return address); one more word
/// aligns it for the call, and the jump leaves the stack as the caller made it.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
#[unsafe(naked)]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    core::arch::naked_asm!(
        "sub rsp, 8",
        "call {prepare}",
        "add rsp, 8",
        "jmp rax",
        prepare = sym vfork_prepare,
    )
}

/// AArch64: the link register is kept across the call and restored before the jump (through
/// x16, which a BTI landing pad accepts).
#[cfg(target_arch = "aarch64")]
#[no_mangle]
#[unsafe(naked)]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-16]!",
        "mov x29, sp",
        "bl {prepare}",
        "ldp x29, x30, [sp], #16",
        "mov x16, x0",
        "br x16",
        prepare = sym vfork_prepare,
    )
}
