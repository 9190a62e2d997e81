#!/usr/bin/env python3
"""Descriptors closed with `syscall(SYS_close, fd)`, as libuv (node) closes its sockets.

    preload-rawclose.py server PORT   (answers ROUNDS connections, closing each through
                                       syscall(SYS_close) — not close(3) — after its answer)
    preload-rawclose.py client PORT   (checks each answer and the end of stream after it)

Under `smc run` the library must see those closes: otherwise the connection stays open in
its table (the client waits for an end of stream that never comes) and the table names a
connection under a number the kernel hands out again to the next accepted socket.
"""
import ctypes
import socket
import sys

ROUNDS = 24
SYS_close = 3  # x86-64 and the generic table (57 on AArch64)
if ctypes.sizeof(ctypes.c_void_p) == 8 and __import__("platform").machine() == "aarch64":
    SYS_close = 57


def server(port):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    seen = set()
    for i in range(ROUNDS):
        c, _ = ls.accept()
        seen.add(c.fileno())
        req = c.recv(100)
        c.sendall(b"answer %d to %s\n" % (i, req.strip()))
        fd = c.detach()
        if libc.syscall(ctypes.c_long(SYS_close), ctypes.c_long(fd)) != 0:
            print("FAIL syscall(SYS_close) errno %d" % ctypes.get_errno(), flush=True)
            sys.exit(1)
    print("ok   %d connections closed through syscall(SYS_close), on %d numbers" % (ROUNDS, len(seen)),
          flush=True)


def client(port):
    for i in range(ROUNDS):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"q%d\n" % i)
        got = b""
        try:
            while True:
                b = s.recv(100)
                if not b:
                    break
                got += b
        except socket.timeout:
            print("FAIL round %d: no end of stream after %r" % (i, got), flush=True)
            sys.exit(1)
        if got != b"answer %d to q%d\n" % (i, i):
            print("FAIL round %d: %r" % (i, got), flush=True)
            sys.exit(1)
        s.close()
    print("ok   %d answers, each followed by the end of stream" % ROUNDS, flush=True)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    (server if role == "server" else client)(port)
