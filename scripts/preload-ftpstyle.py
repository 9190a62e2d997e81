#!/usr/bin/env python3
"""A server that accepts a connection only after its client used another one, as FTP's
passive data connections (scripts/preload-apps.sh, both ends under `smc run`).

    preload-ftpstyle.py server PORT   (control listener on PORT, data listener on PORT+1)
    preload-ftpstyle.py client PORT

The client connects the control connection, then the data connection, waits for the data
connection's writability (poll or epoll, as curl does) or not at all, and only then sends
RETR on the control connection. The server accepts the data connection after reading RETR
and sends 4 MiB on it (SHA-256 on the control connection). Rounds:

    blocking   a blocking data socket
    poll       a nonblocking one, connect, poll(POLLOUT), SO_ERROR; a read before RETR
               gets EAGAIN
    epoll      the same with an epoll instance (level-triggered, then edge-triggered for
               the reads)
    late       the server accepts only after 7 s (past the client's 6 s accept wait):
               the data connection falls back to TCP and the bytes still arrive right

Under `smc run` the data connection's `connect` waited for the server's CLC Accept, which
came only with the server program's accept after RETR: 6 s per data connection
(`SMC_ACCEPT_WAIT_MS`), then a Decline and TCP. Each round prints its wall time; the first
three must take less than 3 s (not a performance figure: the 6 s wait or not).
"""
import hashlib
import os
import select
import socket
import sys
import time

SIZE = 4 << 20
ROUNDS = ["blocking", "poll", "epoll", "late"]
LATE_S = 7.0


def recv_line(s):
    got = bytearray()
    while not got.endswith(b"\n"):
        b = s.recv(1)
        if not b:
            sys.exit("control connection: end of stream")
        got += b
    return got.decode().strip()


def server(port):
    ctl_l = socket.socket()
    ctl_l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ctl_l.bind(("127.0.0.1", port))
    ctl_l.listen(4)
    data_l = socket.socket()
    data_l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    data_l.bind(("127.0.0.1", port + 1))
    data_l.listen(4)
    ctl, _ = ctl_l.accept()
    ctl.sendall(b"220 ready\n")
    for name in ROUNDS:
        cmd = recv_line(ctl)
        if cmd != "RETR " + name:
            sys.exit("server: expected RETR %s, got %r" % (name, cmd))
        if name == "late":
            time.sleep(LATE_S)
        data, _ = data_l.accept()
        payload = os.urandom(SIZE)
        ctl.sendall(b"150 %s\n" % hashlib.sha256(payload).hexdigest().encode())
        data.sendall(payload)
        data.close()
        ctl.sendall(b"226 done\n")
    ctl.close()
    print("ok   server: %d data connections accepted after RETR" % len(ROUNDS))


def read_all(s, wait):
    """Read the data connection to its end; a nonblocking one waits (`wait()`) only after
    EAGAIN, as an edge-triggered reader must."""
    h = hashlib.sha256()
    n = 0
    while True:
        try:
            b = s.recv(1 << 16)
        except BlockingIOError:
            wait()
            continue
        if not b:
            return n, h.hexdigest()
        h.update(b)
        n += len(b)


def data_connection(port, name):
    """Connect the data connection as round `name` does; returns it and its reader."""
    s = socket.socket()
    if name in ("blocking", "late"):
        s.connect(("127.0.0.1", port + 1))
        return s, None
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port + 1))
    except BlockingIOError:
        pass
    if name == "poll":
        p = select.poll()
        p.register(s, select.POLLOUT)
        if not p.poll(5000):
            sys.exit("poll: the data connection never became writable")
        p.modify(s, select.POLLIN)

        def wait():
            p.poll(10000)
    else:
        ep = select.epoll()
        ep.register(s, select.EPOLLOUT)
        if not ep.poll(5):
            sys.exit("epoll: the data connection never became writable")
        ep.modify(s, select.EPOLLIN | select.EPOLLET)

        def wait():
            ep.poll(10)
    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err != 0:
        sys.exit("%s: SO_ERROR %d after writability" % (name, err))
    try:
        s.recv(1)
        sys.exit("%s: a read before RETR returned instead of EAGAIN" % name)
    except BlockingIOError:
        pass
    return s, wait


def client(port):
    ctl = socket.create_connection(("127.0.0.1", port), timeout=30)
    if not recv_line(ctl).startswith("220"):
        sys.exit("no greeting")
    for name in ROUNDS:
        t0 = time.monotonic()
        data, wait = data_connection(port, name)
        connected = time.monotonic() - t0
        ctl.sendall(b"RETR %s\n" % name.encode())
        line = recv_line(ctl)
        if not line.startswith("150 "):
            sys.exit("%s: expected 150, got %r" % (name, line))
        n, digest = read_all(data, wait)
        data.close()
        if recv_line(ctl) != "226 done":
            sys.exit("%s: no 226" % name)
        took = time.monotonic() - t0
        if n != SIZE or digest != line[4:]:
            sys.exit("FAIL %s: %d bytes, SHA-256 %s, expected %d bytes, %s"
                     % (name, n, digest, SIZE, line[4:]))
        print("ok   %-8s connect returned in %.3f s, %d bytes right in %.2f s"
              % (name, connected, n, took))
        if connected >= 3:
            sys.exit("FAIL %s: the data connection's connect took %.1f s (the 6 s wait)"
                     % (name, connected))
        if name != "late" and took >= 3:
            sys.exit("FAIL %s: the transfer took %.1f s (the 6 s wait)" % (name, took))
    ctl.close()


if __name__ == "__main__":
    {"server": server, "client": client}[sys.argv[1]](int(sys.argv[2]))
