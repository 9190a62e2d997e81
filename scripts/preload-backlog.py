#!/usr/bin/env python3
"""A server that accepts several connections before it serves any, and a client that makes
them one after another (scripts/preload-apps.sh, both ends under `smc run`).

    preload-backlog.py server PORT   (accepts 4 connections, then echoes 100 kB on each, in order)
    preload-backlog.py client PORT   (connects 4 times, then sends 100 kB on each and checks
                                      the echo's SHA-256)

Over TCP the kernel completes each handshake before the server's accept. Under `smc run`
the server's CLC answer used to wait for the program's first use of the accepted socket:
the client's first `connect` waited for it, the server waited in its second `accept`, and
after the CLC timeout (30 s) the client's `connect` failed with ETIMEDOUT. The last
connection is served only once the server is done reading the first three: its rendezvous
must run while the server waits in a read of another connection.
"""
import hashlib
import os
import socket
import sys

N = 4
SIZE = 100000


def recv_exact(s, n):
    got = bytearray()
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            sys.exit("end of stream after %d of %d bytes" % (len(got), n))
        got += chunk
    return bytes(got)


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(16)
    conns = [ls.accept()[0] for _ in range(N)]
    for c in conns:
        c.sendall(recv_exact(c, SIZE))
        c.close()
    print("ok   server: %d connections accepted before any was served, each echoed" % N)


def client(port):
    conns = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(N)]
    for i, c in enumerate(conns):
        data = os.urandom(SIZE)
        c.sendall(data)
        if hashlib.sha256(recv_exact(c, SIZE)).digest() != hashlib.sha256(data).digest():
            sys.exit("FAIL connection %d: the echo differs" % i)
        c.close()
    print("ok   client: %d connections made one after another, every echo right" % N)


if __name__ == "__main__":
    {"server": server, "client": client}[sys.argv[1]](int(sys.argv[2]))
