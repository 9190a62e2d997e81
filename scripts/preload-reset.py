#!/usr/bin/env python3
"""What a program sees when its peer resets the connection, checked against TCP's answers.

    preload-reset.py server PORT     (answers each connection, then closes with the request
                                      unread: TCP sends a RST, SMC-R a PeerConnAbort)
    preload-reset.py client PORT     (checks the calls after the reset; exits 0 or 1)

Run both plain (the expectations are TCP's own) and both under `smc run` (SMC-R must give the
same): the answer written before the reset is read whole and first; then the first call to
meet the reset gets ECONNRESET — a read, a write (no SIGPIPE), or SO_ERROR, whichever comes
first — and only once; after it reads return end of stream and writes EPIPE (with SIGPIPE).
This is how a redis client sees a server in protected mode that answers `-DENIED` and closes.
"""
import errno
import signal
import socket
import sys
import time

ANSWER = b"-DENIED " + bytes(range(32, 127)) * 30 + b"\r\n"
CONNECTIONS = 3
FAILED = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    for _ in range(CONNECTIONS):
        c, _ = ls.accept()
        # Wait for the request, leave it unread, answer, close: a reset.
        c.settimeout(10)
        c.recv(1, socket.MSG_PEEK)
        c.sendall(ANSWER)
        time.sleep(0.2)
        c.close()
    ls.close()


def reset_arrived(s):
    """Wait until the reset is there without taking it (POLLHUP/POLLERR, as TCP shows it)."""
    import select
    p = select.poll()
    p.register(s, select.POLLERR | select.POLLHUP)
    deadline = time.time() + 10
    while time.time() < deadline:
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(100)):
            time.sleep(0.1)
            return True
    return False


def errno_of(fn):
    try:
        r = fn()
        return ("ok", r)
    except OSError as e:
        return ("err", e.errno)


def client(port):
    # A SIGPIPE would end the program (as it ends redis-cli): counted instead.
    pipes = []
    signal.signal(signal.SIGPIPE, lambda *_: pipes.append(1))
    for first in ("read", "write", "so_error"):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        check(reset_arrived(s), f"[{first}] the reset arrives")
        before = len(pipes)
        if first == "read":
            got = b""
            while len(got) < len(ANSWER):
                r = errno_of(lambda: s.recv(65536))
                if r[0] != "ok" or not r[1]:
                    break
                got += r[1]
            check(got == ANSWER, f"[read] the answer before the reset, whole ({len(got)} of {len(ANSWER)} bytes)")
            check(errno_of(lambda: s.recv(100)) == ("err", errno.ECONNRESET), "[read] then ECONNRESET")
        elif first == "write":
            check(errno_of(lambda: s.send(b"more")) == ("err", errno.ECONNRESET),
                  "[write] the first write gets ECONNRESET")
            check(len(pipes) == before, "[write] ... and no SIGPIPE")
        else:
            check(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET,
                  "[so_error] SO_ERROR is ECONNRESET")
            check(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "[so_error] once")
        if first != "read":
            got = errno_of(lambda: s.recv(65536))
            check(got[0] == "ok" and got[1] == ANSWER[:len(got[1])] and len(got[1]) > 0,
                  f"[{first}] the answer is still read after the reset was reported")
            while got[0] == "ok" and got[1]:
                got = errno_of(lambda: s.recv(65536))
        check(errno_of(lambda: s.recv(100)) == ("ok", b""), f"[{first}] after the reset: end of stream")
        before = len(pipes)
        check(errno_of(lambda: s.send(b"x")) == ("err", errno.EPIPE), f"[{first}] after the reset: EPIPE")
        check(len(pipes) == before + 1, f"[{first}] ... with SIGPIPE")
        s.close()
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    (server if role == "server" else client)(port)
