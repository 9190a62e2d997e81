//! `execl`, `execlp` and `execle`: the exec calls that take their arguments as a list.
//!
//! The C library's `execl` reaches `execve` inside itself, past this library, so without
//! these a connection handed on through them would reach the new program as an idle TCP
//! socket, on which its reads wait forever. Here each one gathers its list into an array and
//! goes through our `execv`, `execvp` or `execve`, which name the inherited connections to the
//! new program (`hooks::before_exec`).
//!
//! They are variadic in C, which stable Rust cannot define. On the two ABIs this library is
//! built for, a variadic call passes its pointer arguments as a call with that many named
//! ones does (registers first, then the stack, in order), so each entry point is a few
//! instructions of assembly (a naked function): it stores the argument registers next to
//! each other and calls [`exec_list`] with where they are and where the arguments on the
//! caller's stack begin.

use libc::{c_char, c_int};

use crate::{exec, set_errno};

/// Which call the list stands for.
const EXECL: c_int = 0;
const EXECLP: c_int = 1;
const EXECLE: c_int = 2;

/// More arguments than any exec accepts (the kernel's limit is on their bytes, 2 MiB by
/// default, so fewer pointers than this fit): a list without its terminating null pointer is
/// refused with E2BIG once this many were read, instead of reading on through the stack.
const MAX_ARGS: usize = 1 << 20;

/// The list's arguments: the first `nregs` from the saved registers, the rest from the
/// caller's stack.
struct List {
    regs: *const *const c_char,
    nregs: usize,
    stack: *const *const c_char,
}

impl List {
    /// Argument `i` after the path (0 is `arg0`).
    ///
    /// # Safety
    /// The caller passed at least `i + 1` arguments after the path.
    unsafe fn get(&self, i: usize) -> *const c_char {
        if i < self.nregs {
            // SAFETY: the saved registers hold `nregs` arguments.
            unsafe { *self.regs.add(i) }
        } else {
            // SAFETY: the caller passed this argument, on its stack.
            unsafe { *self.stack.add(i - self.nregs) }
        }
    }

    /// The arguments up to and including the null pointer that ends them, and what follows
    /// that null pointer's place (`execle`'s environment). `None`: no null pointer within
    /// [`MAX_ARGS`].
    ///
    /// # Safety
    /// The list is a C exec call's: pointers ended by a null pointer.
    unsafe fn gather(&self) -> Option<(Vec<*const c_char>, usize)> {
        let mut argv = Vec::with_capacity(8);
        for i in 0..MAX_ARGS {
            // SAFETY: every argument before the null pointer was passed, and the null
            // pointer itself.
            let p = unsafe { self.get(i) };
            argv.push(p);
            if p.is_null() {
                return Some((argv, i + 1));
            }
        }
        None
    }
}

/// Gathers the list and makes the call `kind` stands for through this library's own
/// `execv`, `execvp` or `execve`. Returns only when the exec failed (-1, errno set).
///
/// # Safety
/// Called by the entry points below only, with the registers they saved and the caller's
/// stack arguments.
unsafe extern "C" fn exec_list(
    kind: c_int,
    path: *const c_char,
    regs: *const *const c_char,
    nregs: usize,
    stack: *const *const c_char,
) -> c_int {
    let list = List { regs, nregs, stack };
    // SAFETY: the caller's list, as C's exec functions require it.
    let Some((argv, after)) = (unsafe { list.gather() }) else {
        set_errno(libc::E2BIG);
        return -1;
    };
    match kind {
        // SAFETY: the caller's path, its arguments as an array.
        EXECLP => unsafe { exec::execvp(path, argv.as_ptr()) },
        EXECLE => {
            // SAFETY: `execle` passes its environment right after the null pointer.
            let envp = unsafe { list.get(after) } as *const *const c_char;
            // SAFETY: the caller's path, arguments and environment.
            unsafe { exec::execve(path, argv.as_ptr(), envp) }
        }
        // SAFETY: as above.
        _ => unsafe { exec::execv(path, argv.as_ptr()) },
    }
}

/// x86-64 System V: `path` in rdi, the first five list entries in rsi, rdx, rcx, r8 and r9,
/// the rest at 16(%rbp) once rbp is pushed (above the return address). The frame keeps rsp
/// 16-byte aligned at the call.
#[cfg(target_arch = "x86_64")]
macro_rules! list_entry {
    ($name:ident, $kind:expr) => {
        #[no_mangle]
        #[unsafe(naked)]
        pub unsafe extern "C" fn $name() {
            core::arch::naked_asm!(
                "push rbp",
                "mov rbp, rsp",
                "sub rsp, 48",
                "mov [rsp], rsi",
                "mov [rsp + 8], rdx",
                "mov [rsp + 16], rcx",
                "mov [rsp + 24], r8",
                "mov [rsp + 32], r9",
                "mov rsi, rdi",
                "mov edi, {kind}",
                "mov rdx, rsp",
                "mov ecx, 5",
                "lea r8, [rbp + 16]",
                "call {f}",
                "leave",
                "ret",
                kind = const $kind,
                f = sym exec_list,
            )
        }
    };
}

/// AArch64 (AAPCS64 as Linux uses it, where variadic arguments go as named ones): `path` in
/// x0, the first seven list entries in x1–x7, the rest at the caller's sp (80 above ours
/// once the frame is made).
#[cfg(target_arch = "aarch64")]
macro_rules! list_entry {
    ($name:ident, $kind:expr) => {
        #[no_mangle]
        #[unsafe(naked)]
        pub unsafe extern "C" fn $name() {
            core::arch::naked_asm!(
                "stp x29, x30, [sp, #-80]!",
                "mov x29, sp",
                "stp x1, x2, [sp, #16]",
                "stp x3, x4, [sp, #32]",
                "stp x5, x6, [sp, #48]",
                "str x7, [sp, #64]",
                "mov x1, x0",
                "mov x0, #{kind}",
                "add x2, sp, #16",
                "mov x3, #7",
                "add x4, sp, #80",
                "bl {f}",
                "ldp x29, x30, [sp], #80",
                "ret",
                kind = const $kind,
                f = sym exec_list,
            )
        }
    };
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
list_entry!(execl, EXECL);
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
list_entry!(execlp, EXECLP);
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
list_entry!(execle, EXECLE);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_read_from_the_registers_then_the_stack() {
        let s: Vec<std::ffi::CString> = (0..9)
            .map(|i| std::ffi::CString::new(format!("a{i}")).expect("c"))
            .collect();
        let regs = [s[0].as_ptr(), s[1].as_ptr(), s[2].as_ptr()];
        let env = 0x1234usize as *const c_char;
        let stack = [s[3].as_ptr(), s[4].as_ptr(), std::ptr::null(), env];
        let list = List {
            regs: regs.as_ptr(),
            nregs: 3,
            stack: stack.as_ptr(),
        };
        // SAFETY: five entries and the null pointer, then one more word.
        let (argv, after) = unsafe { list.gather() }.expect("ended");
        assert_eq!(argv.len(), 6);
        assert!(argv[5].is_null());
        assert_eq!(argv[3], s[3].as_ptr());
        assert_eq!(after, 6);
        // SAFETY: the word after the null pointer.
        assert_eq!(unsafe { list.get(after) }, env);
        // A null pointer among the registers ends the list there.
        let regs = [s[0].as_ptr(), std::ptr::null(), s[2].as_ptr()];
        let list = List {
            regs: regs.as_ptr(),
            nregs: 3,
            stack: stack.as_ptr(),
        };
        // SAFETY: one entry and the null pointer.
        let (argv, after) = unsafe { list.gather() }.expect("ended");
        assert_eq!((argv.len(), after), (2, 2));
    }
}
