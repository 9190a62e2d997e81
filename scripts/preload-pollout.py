#!/usr/bin/env python3
"""poll's POLLOUT as TCP's: reported once a good part of the send space is free, not for
the first free byte.

    preload-pollout.py server PORT   (reads the data connection only when told to, on a
                                      second, control connection)
    preload-pollout.py client PORT   (fills the data connection, then polls for POLLOUT)

Linux's tcp_poll reports POLLOUT when the free send space is at least half of what is
queued (sk_stream_is_writeable). Under `smc run` the library reported any room in the peer's
RMBE: a program that polls, then writes its buffer to a blocking socket (socat: 8 KiB) waited
in the write with its own input unread, and a chain socat -> stunnel4 -> stunnel4 -> socat
echo stopped for good with every RMBE full (a 200 MB echo, after 9 to 45 MB). The client
fills the connection (nonblocking writes until EAGAIN), lets the server read 64 KiB, and
checks that no POLLOUT comes within 0.5 s (TCP: none either); then lets it read the rest
and checks that POLLOUT comes. Run plain and under `smc run` by preload-apps.sh.
"""
import select
import socket
import sys


def recv_exact(s, n):
    got = 0
    while got < n:
        b = s.recv(min(65536, n - got))
        if not b:
            raise RuntimeError(f"end of stream after {got} of {n} bytes")
        got += len(b)


def server(port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(2)
    data, _ = ls.accept()
    ctl, _ = ls.accept()
    f = ctl.makefile("rwb", buffering=0)
    while True:
        line = f.readline()
        if not line:
            break
        n = int(line)
        recv_exact(data, n)
        f.write(b"done\n")
    print("server: done")


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "server":
        server(port)
        return
    data = socket.create_connection(("127.0.0.1", port))
    ctl = socket.create_connection(("127.0.0.1", port))
    f = ctl.makefile("rwb", buffering=0)
    data.setblocking(False)
    total = 0
    chunk = b"x" * 65536
    while True:
        try:
            total += data.send(chunk)
        except BlockingIOError:
            break
    p = select.poll()
    p.register(data, select.POLLOUT)
    if p.poll(0):
        raise SystemExit(f"FAIL: POLLOUT right after EAGAIN ({total} bytes written)")
    f.write(b"65536\n")
    assert f.readline() == b"done\n"
    ev = p.poll(500)
    if ev:
        raise SystemExit(f"FAIL: POLLOUT with only 64 KiB of {total} bytes read: {ev}")
    print(f"ok: no POLLOUT after the peer read 64 KiB of the {total} bytes written")
    f.write(b"%d\n" % (total - 65536))
    assert f.readline() == b"done\n"
    ev = p.poll(5000)
    if not ev or not ev[0][1] & select.POLLOUT:
        raise SystemExit(f"FAIL: no POLLOUT after the peer read everything: {ev}")
    print("ok: POLLOUT once the peer read everything")
    ctl.close()
    data.close()


main()
