#!/usr/bin/env python3
"""Accepted connections served by a process made by a raw `clone` system call, as vsftpd
makes its session processes (for their namespaces): no fork handler runs in it.

    preload-rawclone.py server PORT   (accepts two connections; each is served by a child
                                       made by syscall(SYS_clone, SIGCHLD), which moves it
                                       to its standard input, greets and echoes a payload;
                                       the second child first lowers RLIMIT_NOFILE to 3, so
                                       that the library can make nothing there)
    preload-rawclone.py client PORT   (checks the greeting and the echo of each)

    A third argument 1 runs the first connection only.

Under `smc run` the library must tell such a child from a `vfork` child (which shares its
parent's memory and must leave the table alone): before, its `dup2` was not recorded, the
greeting went out on the TCP socket unannounced and the client, waiting for the CLC Accept,
failed ("malformed CLC header", ECONNABORTED). The first child serves over SMC-R with a stack
of its own; in the second none can be made, so the client is declined and both use TCP.
The second lost its greeting in about 4 of 10 runs before: the client's rendezvous, finding
nothing to read yet, slept in a read of its whole buffer, which took the Decline and the
greeting behind it together whenever both were in when it woke.
"""
import ctypes
import hashlib
import os
import platform
import resource
import signal
import socket
import sys

SYS_clone = 220 if platform.machine() == "aarch64" else 56
SIZE = 300000  # within the buffers both ways: the client reads the echo only after sending


def serve(c, limit):
    os.dup2(c.fileno(), 0)
    c.close()
    if limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, 3))
    os.write(0, b"hello\n")
    left = SIZE
    while left:
        b = os.read(0, min(left, 65536))
        if not b:
            break
        os.write(0, b)
        left -= len(b)


def server(port, rounds):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    for limit in (False, True)[:rounds]:
        c, _ = ls.accept()
        pid = libc.syscall(ctypes.c_long(SYS_clone), ctypes.c_long(signal.SIGCHLD), ctypes.c_long(0),
                           ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0))
        if pid == 0:
            code = 1
            try:
                ls.close()
                serve(c, limit)
                code = 0
            except Exception as e:  # noqa: BLE001 (reported, then the child ends)
                print("FAIL child: %r" % e, flush=True)
            finally:
                os._exit(code)
        c.close()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("FAIL child exited with status %d" % status, flush=True)
            sys.exit(1)
    print("ok   %d connections served by raw clone children" % rounds, flush=True)


def client(port, rounds):
    data = os.urandom(SIZE)
    for i in range(rounds):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        f = s.makefile("rb")
        try:
            hello = f.readline()
            s.sendall(data)
            got = f.read(SIZE)
        except socket.timeout:
            print("FAIL round %d: no answer" % i, flush=True)
            sys.exit(1)
        if hello != b"hello\n" or hashlib.sha256(got).digest() != hashlib.sha256(data).digest():
            print("FAIL round %d: %r, %d bytes" % (i, hello, len(got)), flush=True)
            sys.exit(1)
        s.close()
    print("ok   %d greetings and echoes of %d bytes from raw clone children" % (rounds, SIZE), flush=True)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    (server if role == "server" else client)(port, rounds)
