#!/usr/bin/env python3
"""An accepted connection handed to an exec'd program before the server used it, as sshd
(re-executing itself with the connection on its standard input) and inetd-style servers do.

    preload-execaccept.py server PORT   (accepts ROUNDS connections; for each, a forked child
                                         puts it on its standard input and output and execs
                                         this script as the handler)
    preload-execaccept.py handler       (greets, reads a length and that many bytes from
                                         standard input, answers their SHA-256)
    preload-execaccept.py client PORT   (checks the greeting and each answer)

Under `smc run` the client offers SMC-R and the server's rendezvous would run at the first
use of the accepted socket — in the new program, whose library has no table: it read the
client's CLC Proposal as its own data and the client waited for an Accept. The library
settles such a connection as TCP before the exec (the Proposal read and declined), so the
handler gets the TCP connection as it is, as without the library.
"""
import hashlib
import os
import socket
import sys

ROUNDS = 3
SIZE = 1000000


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    for _ in range(ROUNDS):
        c, _ = ls.accept()
        pid = os.fork()
        if pid == 0:
            ls.close()
            os.dup2(c.fileno(), 0)
            os.dup2(c.fileno(), 1)
            c.close()
            os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "handler"])
        c.close()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("FAIL handler exited with status %d" % status, flush=True)
            sys.exit(1)
    print("ok   %d connections served by exec'd handlers" % ROUNDS, flush=True)


def handler():
    os.write(1, b"hello\n")
    f = os.fdopen(0, "rb", buffering=0)
    line = b""
    while not line.endswith(b"\n") and len(line) < 32:
        b = f.read(1)
        if not b:
            break
        line += b
    n = int(line) if line.strip().isdigit() else -1
    h = hashlib.sha256()
    left = max(n, 0)
    while left:
        b = f.read(min(left, 65536))
        if not b:
            break
        h.update(b)
        left -= len(b)
    os.write(1, (h.hexdigest() if n >= 0 and left == 0 else "bad request %r" % line).encode() + b"\n")


def client(port):
    data = os.urandom(SIZE)
    want = hashlib.sha256(data).hexdigest().encode() + b"\n"
    for i in range(ROUNDS):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        f = s.makefile("rb")
        try:
            hello = f.readline()
            s.sendall(b"%d\n" % SIZE + data)
            got = f.readline()
        except socket.timeout:
            print("FAIL round %d: no answer" % i, flush=True)
            sys.exit(1)
        if hello != b"hello\n" or got != want:
            print("FAIL round %d: %r, %r" % (i, hello, got[:80]), flush=True)
            sys.exit(1)
        s.close()
    print("ok   %d greetings and SHA-256 answers of %d bytes from exec'd handlers" % (ROUNDS, SIZE),
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "handler":
        handler()
    else:
        role, port = sys.argv[1], int(sys.argv[2])
        (server if role == "server" else client)(port)
