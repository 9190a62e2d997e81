#!/usr/bin/env python3
"""The descriptor numbers a program gets, printed so that a run under `smc run` can be compared
with a plain run (scripts/preload-apps.sh): the library's own descriptors must not take the
low numbers the program counts on (wrk sizes its event loop by them, select() by FD_SETSIZE).

server PORT: accept 4 connections, echo 1000 bytes on each as it comes.
client PORT: connect 4 times, 1000 bytes each way on each. Both then make a pipe and a socket
and print every number they got, in order.
"""
import os
import socket
import sys

mode, port = sys.argv[1], int(sys.argv[2])
nums = []
conns = []


def exchange(s, first):
    if first:
        s.sendall(b"x" * 1000)
    got = b""
    while len(got) < 1000:
        chunk = s.recv(1000 - len(got))
        if not chunk:
            sys.exit("%s: end of stream after %d bytes" % (mode, len(got)))
        got += chunk
    if not first:
        s.sendall(got)


if mode == "server":
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port))
    l.listen(16)
    nums.append(l.fileno())
    for _ in range(4):
        s, _ = l.accept()
        nums.append(s.fileno())
        conns.append(s)
        exchange(s, first=False)
else:
    for _ in range(4):
        c = socket.create_connection(("127.0.0.1", port))
        nums.append(c.fileno())
        conns.append(c)
        exchange(c, first=True)
r, w = os.pipe()
nums += [r, w]
extra = socket.socket()
nums.append(extra.fileno())
print(mode, " ".join(map(str, nums)))
