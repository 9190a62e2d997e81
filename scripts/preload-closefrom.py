#!/usr/bin/env python3
"""A program that closes every descriptor it did not make after its stack exists, as
varnishd's manager does (`closefrom(3)` after it tried its listening address).

    preload-closefrom.py server PORT   (serves one echo on PORT, then closefrom(3) through
                                        the C library; one on PORT+1, then os.closerange(3,
                                        soft RLIMIT_NOFILE): close_range(2); one on PORT+2)
    preload-closefrom.py client PORT   (1 MB echoed on each, SHA-256 checked)

Under `smc run` the stack's descriptors (upper half of the limit) must survive both: before,
closefrom(3) closed them under the library's threads, which then spun (varnishd's manager:
three threads at 13-20 % CPU for good), and the next listen could not mark its port (EBADF
on the discovery's map): its connections stayed TCP. preload-apps.sh counts the SMC-R ends
(6 expected: the connections before and after each kind of close, both ends).
"""
import ctypes
import hashlib
import os
import resource
import socket
import sys
import time

N = 1_000_000


def echo_one(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(1)
    c, _ = ls.accept()
    ls.close()
    got = 0
    while got < N:
        b = c.recv(65536)
        if not b:
            raise RuntimeError(f"end of stream after {got} bytes")
        c.sendall(b)
        got += len(b)
    c.shutdown(socket.SHUT_WR)
    if c.recv(1):
        raise RuntimeError("bytes after the request")
    c.close()


def server(port):
    libc = ctypes.CDLL(None, use_errno=True)
    echo_one(port)
    libc.closefrom(3)
    print("server: closefrom(3) done")
    echo_one(port + 1)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(3, soft)
    print(f"server: closerange(3, {soft}) done")
    echo_one(port + 2)
    print("server: 3 echoes of 1 MB served")


def client(port):
    data = os.urandom(N)
    for p in (port, port + 1, port + 2):
        deadline = time.monotonic() + 20
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", p))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        h, got = hashlib.sha256(), 0
        while True:
            b = s.recv(65536)
            if not b:
                break
            h.update(b)
            got += len(b)
        s.close()
        if got != N or h.digest() != hashlib.sha256(data).digest():
            raise RuntimeError(f"port {p}: {got} of {N} bytes back, or a different SHA-256")
        print(f"client: echo of 1 MB on port {p} right")


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    try:
        server(port) if mode == "server" else client(port)
    except Exception as e:  # noqa: BLE001 - any failure is the check's failure
        print(f"preload-closefrom {mode}: {e!r}")
        sys.exit(1)


main()
