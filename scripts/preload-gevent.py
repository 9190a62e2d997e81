"""A gevent (libev loop, greenlets) echo server and client for scripts/preload-apps.sh.

  python3 preload-gevent.py server PORT CONNS        echo CONNS connections, then exit
  python3 preload-gevent.py client PORT CONNS BYTES  CONNS concurrent connections, BYTES each way

gevent's sockets are nonblocking; a greenlet that would block waits in libev's epoll loop
for the descriptor (an I/O watcher started and stopped per wait). Each client connection
writes BYTES of random data in 100 kB pieces from one greenlet (then shutdown(SHUT_WR))
while another reads the echo to the end of stream; the SHA-256 of what came back must be
the one of what was sent. Exit 1 on a mismatch, an error or after 60 s.
"""

import hashlib
import os
import socket as _socket
import sys

import gevent
from gevent import socket
from gevent.server import StreamServer


def server(port, conns):
    left = [conns, 0]
    done = gevent.event.Event()

    def handle(s, _addr):
        while True:
            b = s.recv(65536)
            if not b:
                break
            left[1] += len(b)
            s.sendall(b)
        s.shutdown(_socket.SHUT_WR)
        s.close()
        left[0] -= 1
        if left[0] == 0:
            done.set()

    srv = StreamServer(("127.0.0.1", port), handle)
    srv.start()
    done.wait()
    srv.stop()
    print(f"gevent server: {conns} connections, {left[1]} bytes echoed")


def one(port, i, n):
    data = os.urandom(n)
    s = socket.create_connection(("127.0.0.1", port))

    def send():
        for k in range(0, n, 100_000):
            s.sendall(data[k : k + 100_000])
        s.shutdown(_socket.SHUT_WR)

    t = gevent.spawn(send)
    h, got = hashlib.sha256(), 0
    while True:
        b = s.recv(65536)
        if not b:
            break
        h.update(b)
        got += len(b)
    t.get()
    s.close()
    if got != n or h.digest() != hashlib.sha256(data).digest():
        raise RuntimeError(f"connection {i}: {got} of {n} bytes back, or a different SHA-256")


def client(port, conns, n):
    gs = [gevent.spawn(one, port, i, n) for i in range(conns)]
    for g in gs:
        g.get()
    print(f"gevent client: {conns} connections, {n} bytes each, echoes right")


def main():
    import gevent.event  # noqa: F401 - gevent.event.Event above

    mode, port, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        with gevent.Timeout(60):
            if mode == "server":
                server(port, conns)
            else:
                client(port, conns, int(sys.argv[4]))
    except BaseException as e:  # noqa: BLE001 - any failure (the Timeout too) is the check's
        print(f"preload-gevent: {e!r}")
        sys.exit(1)


main()
