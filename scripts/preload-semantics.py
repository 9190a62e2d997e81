#!/usr/bin/env python3
"""The socket semantics a program sees under `smc run`, checked call by call (docs/preload.md).

    preload-semantics.py server PORT SMC   (under `smc run`: checks, then exits 0 or 1)
    preload-semantics.py client PORT SMC   (under `smc run`: does what the server asks)

The server drives: it asks the client, over the connection itself, to send bytes or to shut
down, and checks what epoll (level- and edge-triggered, one-shot, RDHUP), poll and select
mixed with a pipe, FIONREAD, dup, nonblocking reads, sendfile and the end of stream report.
The client connects nonblocking (EINPROGRESS or 0, then POLLOUT and SO_ERROR), checks with
`smc ss --json` that its connection is SMC-R, and verifies the sendfile payload.
"""
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

FAILED = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def ask(conn, line):
    conn.sendall(line.encode() + b"\n")


def wait_readable(conn, timeout=5.0):
    p = select.poll()
    p.register(conn, select.POLLIN)
    return bool(p.poll(timeout * 1000))


def smc_mode_of_pid(smc, pid, port):
    out = subprocess.run([smc, "ss", "--json"], capture_output=True, text=True, check=True).stdout
    for st in json.loads(out):
        if st["pid"] == str(pid):
            for s in st["ss"]:
                if s.get("peer", "").endswith(f":{port}") or s.get("local", "").endswith(f":{port}"):
                    return s.get("mode")
    return None


def server(port, smc):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(4)
    conn, _ = ls.accept()
    fd = conn.fileno()

    # epoll, level-triggered: stays ready until everything is read.
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    ask(conn, "send 10 a")
    ev = ep.poll(5)
    check(ev == [(fd, select.EPOLLIN)], f"LT: EPOLLIN after data ({ev})")
    check(ep.poll(0.2) == [(fd, select.EPOLLIN)], "LT: still EPOLLIN while unread")
    check(conn.recv(5) == b"aaaaa", "LT: read 5")
    check(ep.poll(0.2) == [(fd, select.EPOLLIN)], "LT: EPOLLIN with 5 left")
    check(conn.recv(5) == b"aaaaa", "LT: read the other 5")
    check(ep.poll(0.2) == [], "LT: nothing when all is read")

    # The connection is SMC-R in this process's stack (set up at its first use, above).
    mode = None
    for _ in range(50):
        mode = smc_mode_of_pid(smc, os.getpid(), port)
        if mode:
            break
        time.sleep(0.05)
    check(mode == "SMC-R", f"server side is SMC-R (smc ss says {mode})")

    # Edge-triggered: one report per arrival.
    ep.modify(fd, select.EPOLLIN | select.EPOLLET)
    ask(conn, "send 3 b")
    # Let the bytes land first: data arriving in the instant the library gathers readiness
    # can be reported twice (never missed; docs/preload.md, "Edge-triggered epoll"), which is
    # not what this check is about.
    wait_readable(conn)
    ev = ep.poll(5)
    check(ev == [(fd, select.EPOLLIN)], f"ET: EPOLLIN on arrival ({ev})")
    check(ep.poll(0.2) == [], "ET: no second report without new data")
    ask(conn, "send 2 b")
    ev = ep.poll(5)
    check(ev == [(fd, select.EPOLLIN)], f"ET: EPOLLIN on the next arrival ({ev})")
    time.sleep(0.05)
    check(conn.recv(100) == b"bbbbb", "ET: both arrivals read")

    # One-shot: silent after the report until EPOLL_CTL_MOD.
    ep.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
    ask(conn, "send 1 c")
    check(ep.poll(5) == [(fd, select.EPOLLIN)], "ONESHOT: reported once")
    check(ep.poll(0.2) == [], "ONESHOT: silent until re-armed")
    ep.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
    check(ep.poll(1) == [(fd, select.EPOLLIN)], "ONESHOT: reported after MOD")
    check(conn.recv(10) == b"c", "ONESHOT: data read")
    ep.unregister(fd)
    try:
        ep.unregister(fd)
        check(False, "DEL of an unregistered connection fails with ENOENT")
    except OSError as e:
        check(e.errno == errno.ENOENT, "DEL of an unregistered connection fails with ENOENT")

    # Removed and added again, as an event loop that changes its interest per request does
    # (redis-benchmark: DEL and ADD twice per request; the library keeps the connection's
    # kernel registration through a DEL, docs/preload.md).
    ep.register(fd, select.EPOLLIN)
    ep.unregister(fd)
    ask(conn, "send 2 r")
    wait_readable(conn)
    check(ep.poll(0.2) == [], "DEL: data on a removed connection is not reported")
    try:
        ep.modify(fd, select.EPOLLIN)
        check(False, "MOD of a removed connection fails with ENOENT")
    except OSError as e:
        check(e.errno == errno.ENOENT, "MOD of a removed connection fails with ENOENT")
    ep.register(fd, select.EPOLLIN | select.EPOLLET)
    check(ep.poll(1) == [(fd, select.EPOLLIN)], "ADD after DEL: the unread data is reported (ET)")
    check(ep.poll(0.2) == [], "ADD after DEL, ET: reported once")
    try:
        ep.register(fd, select.EPOLLIN)
        check(False, "ADD after DEL and ADD fails with EEXIST")
    except OSError as e:
        check(e.errno == errno.EEXIST, "ADD after DEL and ADD fails with EEXIST")
    check(conn.recv(10) == b"rr", "ADD after DEL: data read")
    for i in range(3):
        ep.unregister(fd)
        ep.register(fd, select.EPOLLIN)
        ask(conn, "send 1 s")
        ev = ep.poll(5)
        check(ev == [(fd, select.EPOLLIN)], f"ADD after DEL, round {i}: a waiting epoll_wait reports new data ({ev})")
        check(conn.recv(10) == b"s", f"ADD after DEL, round {i}: data read")
    ep.unregister(fd)

    # An epoll instance waited on by another wait (an outer epoll instance, then poll): the
    # connection's eventfds are written only while a wait is armed, and such a wait sleeps
    # in the kernel unarmed, so the library arms the inner instance's connections for good.
    # The inner instances are only ever asked with a zero timeout here: a sleeping wait on
    # them would register the stack's completion channels in them, whose doorbells would
    # wake the outer wait as well.
    def quiet_inner():
        inner = select.epoll()
        inner.register(fd, select.EPOLLIN)
        # (The registration's first kernel event, from earlier signals, is consumed here.)
        check(inner.poll(0) == [], "nested epoll: nothing before data")
        return inner

    inner = quiet_inner()
    outer = select.epoll()
    outer.register(inner.fileno(), select.EPOLLIN)
    check(outer.poll(0.1) == [], "nested epoll: outer instance quiet before data")
    ask(conn, "send 1 n")
    ev = outer.poll(5)
    check(ev == [(inner.fileno(), select.EPOLLIN)], f"nested epoll: the outer instance wakes ({ev})")
    check(inner.poll(0) == [(fd, select.EPOLLIN)], "nested epoll: the inner one reports the connection")
    check(conn.recv(10) == b"n", "nested epoll: data read")
    outer.close()
    inner.close()
    inner = quiet_inner()
    pi = select.poll()
    pi.register(inner.fileno(), select.POLLIN)
    ask(conn, "send 1 o")
    got = pi.poll(5000)
    check(got == [(inner.fileno(), select.POLLIN)], f"poll on an epoll instance wakes on data ({got})")
    check(conn.recv(10) == b"o", "poll on an epoll instance: data read")
    inner.close()

    # A kernel fd (pipe) and the connection in one epoll set and in one poll.
    r, w = os.pipe()
    ep.register(r, select.EPOLLIN)
    ep.register(fd, select.EPOLLIN)
    os.write(w, b"x")
    check(ep.poll(1) == [(r, select.EPOLLIN)], "epoll: the pipe alone is ready")
    os.read(r, 1)
    ask(conn, "send 4 d")
    check(ep.poll(5) == [(fd, select.EPOLLIN)], "epoll: the connection alone is ready")
    ep.unregister(fd)
    p = select.poll()
    p.register(r, select.POLLIN)
    p.register(fd, select.POLLIN)
    got = dict(p.poll(1000))
    check(got.get(fd) == select.POLLIN and r not in got, f"poll: connection ready, pipe not ({got})")
    rl, _, _ = select.select([r, fd], [], [], 1)
    check(rl == [fd], f"select: connection readable ({rl})")
    _, wl, _ = select.select([], [fd], [], 1)
    check(wl == [fd], "select: connection writable")

    # MSG_PEEK leaves the bytes for the next read (and readiness stays).
    check(conn.recv(2, socket.MSG_PEEK) == b"dd", "MSG_PEEK sees 2 bytes")
    check(conn.recv(2, socket.MSG_PEEK) == b"dd", "MSG_PEEK again sees the same")
    check(dict(p.poll(0)).get(fd) == select.POLLIN, "readable after a peek")

    # FIONREAD counts the readable bytes.
    buf = fcntl.ioctl(fd, termios.FIONREAD, struct.pack("i", 0))
    check(struct.unpack("i", buf)[0] == 4, "FIONREAD = 4")
    check(conn.recv(4) == b"dddd", "read after FIONREAD")

    # Nonblocking read with nothing there: EAGAIN.
    conn.setblocking(False)
    try:
        conn.recv(10)
        check(False, "nonblocking read without data: EAGAIN")
    except BlockingIOError:
        check(True, "nonblocking read without data: EAGAIN")
    conn.setblocking(True)

    # A blocking read with nothing to read returns when a signal handler runs (the handler
    # raises, so Python does not retry the EINTR), and SO_RCVTIMEO ends it with EAGAIN.
    class Alarm(Exception):
        pass

    def on_alarm(*_):
        raise Alarm()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        conn.recv(10)
        check(False, "blocking read interrupted by a signal (EINTR)")
    except Alarm:
        check(time.monotonic() - t0 < 5, "blocking read interrupted by a signal (EINTR)")
    signal.setitimer(signal.ITIMER_REAL, 0)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
    t0 = time.monotonic()
    try:
        conn.recv(10)
        check(False, "SO_RCVTIMEO: EAGAIN after the timeout")
    except BlockingIOError:
        check(0.15 < time.monotonic() - t0 < 5, "SO_RCVTIMEO: EAGAIN after the timeout")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))

    # dup: the new number names the same connection; the connection outlives the first.
    d = os.dup(fd)
    ask(conn, "send 6 e")
    check(wait_readable(conn), "data for the dup")
    check(os.read(d, 100) == b"eeeeee", "read through the dup")
    ask(conn, "expect dup-write")
    os.write(d, b"dup-write\n")

    # sendfile with an offset: the file position stays.
    data = os.urandom(300_000)
    path = f"/tmp/preload-semantics-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "rb") as f:
        ask(conn, f"recv {len(data) - 1000} {hashlib.sha256(data[1000:]).hexdigest()}")
        off, left = 1000, len(data) - 1000
        while left:
            n = os.sendfile(fd, f.fileno(), off, left)
            off += n
            left -= n
        check(f.tell() == 0, "sendfile with an offset leaves the file position")
    os.unlink(path)
    line = conn.makefile("rb").readline()
    check(line == b"recv ok\n", f"client verified the sendfile payload ({line!r})")

    rare_call_checks(conn, fd)

    # One thread sends a large payload while another reads the echo from the same
    # connection: with a socket timeout (Python polls before each call: two threads poll
    # one connection) and blocking (a read and a write blocked at once).
    for label, timeout in (("polling threads", 20.0), ("blocking threads", None)):
        data = os.urandom(16 << 20)
        ask(conn, f"echo {len(data)}")
        conn.settimeout(timeout)
        got = bytearray()
        errors = []

        def reader():
            try:
                while len(got) < len(data):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    got.extend(chunk)
            except OSError as e:
                errors.append(repr(e))

        t = threading.Thread(target=reader)
        t.start()
        try:
            conn.sendall(data)
        except OSError as e:
            errors.append(repr(e))
        t.join(30)
        check(not t.is_alive() and not errors and bytes(got) == data,
              f"{label}: 16 MiB sent by one thread, its echo read by another "
              f"({len(got)} bytes back, {errors})")
        if FAILED:
            # The stream is out of step with the client: nothing further can be checked.
            conn.close()
            sys.exit(1)
        conn.settimeout(None)

    # The client shuts down writing: EPOLLIN|EPOLLRDHUP, then end of stream.
    ep2 = select.epoll()
    ep2.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
    ask(conn, "shutdown")
    ev = ep2.poll(5)
    check(ev and ev[0][1] & select.EPOLLRDHUP and ev[0][1] & select.EPOLLIN,
          f"EPOLLIN|EPOLLRDHUP after the peer's shutdown ({ev})")
    check(conn.recv(10) == b"", "end of stream after the peer's shutdown")
    os.close(d)
    conn.close()
    self_connect_checks(port + 1)
    if FAILED:
        print(f"{len(FAILED)} checks failed", flush=True)
        sys.exit(1)
    print("all checks passed", flush=True)


class MMsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.c_void_p), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int), ("pad", ctypes.c_int), ("len", ctypes.c_uint),
                ("pad2", ctypes.c_uint)]


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def rare_call_checks(conn, fd):
    """recvmmsg/sendmmsg, splice, epoll_pwait2, EPOLLEXCLUSIVE, close_range, posix_spawn on
    the connection: as on TCP (ctypes finds the preloaded functions first, as a C program's
    calls do)."""
    libc = ctypes.CDLL(None, use_errno=True)
    # recvmmsg: one recvmsg per header, the second without waiting (MSG_WAITFORONE).
    ask(conn, "send 6 m")
    bufs = [ctypes.create_string_buffer(3) for _ in range(2)]
    iovs = [IoVec(ctypes.cast(b, ctypes.c_void_p), 3) for b in bufs]
    hdrs = (MMsgHdr * 2)()
    for h, v in zip(hdrs, iovs):
        h.iov, h.iovlen = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p), 1
    check(wait_readable(conn), "data for recvmmsg")
    time.sleep(0.05)
    n = libc.recvmmsg(fd, hdrs, 2, 0x10000, None)  # MSG_WAITFORONE
    check(n == 2 and [h.len for h in hdrs] == [3, 3] and bufs[0].raw + bufs[1].raw == b"mmmmmm",
          f"recvmmsg: two messages of 3 bytes ({n}, {[h.len for h in hdrs]})")
    # sendmmsg: two messages, one line at the client.
    ask(conn, "expect sendmmsg")
    out = [ctypes.create_string_buffer(b"sendm", 5), ctypes.create_string_buffer(b"msg\n", 4)]
    iovs = [IoVec(ctypes.cast(b, ctypes.c_void_p), len(b.raw)) for b in out]
    hdrs = (MMsgHdr * 2)()
    for h, v in zip(hdrs, iovs):
        h.iov, h.iovlen = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p), 1
    n = libc.sendmmsg(fd, hdrs, 2, 0)
    check(n == 2 and [h.len for h in hdrs] == [5, 4], f"sendmmsg: two messages sent ({n})")

    # splice: connection → pipe, pipe → connection.
    r, w = os.pipe()
    ask(conn, "send 5 s")
    check(wait_readable(conn), "data for splice")
    n = os.splice(fd, w, 5)
    check(n == 5 and os.read(r, 5) == b"sssss", f"splice from the connection into a pipe ({n})")
    ask(conn, "expect spliced")
    os.write(w, b"spliced\n")
    n = os.splice(r, fd, 8)
    check(n == 8, f"splice from a pipe into the connection ({n})")
    # splice into a pipe whose pages are partly used: 31597 bytes held in 8 of its 16 pages
    # leave 8 pages (32768 bytes) free, less than its capacity less FIONREAD (33939). As
    # from TCP, the splice moves what the free pages take and does not wait (haproxy's
    # splice forwarding waited forever on its own pipe), and no byte is lost.
    r2, w2 = os.pipe()
    os.write(w2, b"x" * 65536)
    os.read(r2, 33939)
    ask(conn, "seq 40000")
    want = bytes(i * 7 % 251 for i in range(40000))
    deadline = time.monotonic() + 5
    while (struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] < 40000
           and time.monotonic() < deadline):
        time.sleep(0.01)

    class Stuck(Exception):
        pass

    def stuck(*_):
        raise Stuck()

    old_alarm = signal.signal(signal.SIGALRM, stuck)
    signal.setitimer(signal.ITIMER_REAL, 5, 0.2)  # again and again: a wait is interrupted
    try:
        n = os.splice(fd, w2, 65536, flags=os.SPLICE_F_NONBLOCK)
    except Stuck:
        n = -1
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old_alarm)
    check(0 < n <= 32768, f"splice into a pipe with partly used pages: what fits, no wait ({n})")
    held = b""
    while len(held) < 31597 + max(n, 0):
        held += os.read(r2, 65536)
    rest = b""
    while n > 0 and len(rest) < 40000 - n:
        rest += conn.recv(65536)
    check(held[:31597] == b"x" * 31597 and held[31597:] + rest == want,
          "splice into a pipe with partly used pages: every byte once, in order")
    if n <= 0:
        conn.settimeout(0.5)  # failed: what is left must not confuse the checks that follow
        try:
            while conn.recv(65536):
                pass
        except socket.timeout:
            pass
        conn.settimeout(None)
    os.close(r2)
    os.close(w2)
    try:
        os.splice(fd, fd, 1)
        check(False, "splice between two sockets: EINVAL")
    except OSError as e:
        check(e.errno == errno.EINVAL, f"splice between two sockets: EINVAL ({e.errno})")

    # epoll_pwait2 (nanosecond timeout) reports the connection.
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN)
    ask(conn, "send 1 z")
    evs = (ctypes.c_uint8 * (12 * 4))()
    ts = (ctypes.c_long * 2)(5, 0)
    n = libc.epoll_pwait2(ep.fileno(), evs, 4, ts, None)
    events = struct.unpack_from("=I", bytes(evs), 0)[0] if n > 0 else 0
    check(n == 1 and events & select.EPOLLIN, f"epoll_pwait2 reports the connection ({n})")
    check(conn.recv(1) == b"z", "read after epoll_pwait2")

    # A thread asleep in epoll_wait on an instance that watched no connection when the wait
    # began is woken when another thread adds a ready connection, as the kernel wakes it
    # (BEAM's poll thread: Erlang's gen_tcp never read its data).
    ep3 = select.epoll()
    woke = []
    sleeper = threading.Thread(target=lambda: woke.append(ep3.poll(5)))
    sleeper.start()
    time.sleep(0.2)
    ask(conn, "send 1 w")
    check(wait_readable(conn), "data for the late registration")
    ep3.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
    sleeper.join()
    check(woke == [[(fd, select.EPOLLIN)]], f"a sleeping epoll_wait reports a connection added meanwhile ({woke})")
    check(conn.recv(1) == b"w", "read after the late registration")
    ep3.close()
    ts = (ctypes.c_long * 2)(0, 20_000_000)
    check(libc.epoll_pwait2(ep.fileno(), evs, 4, ts, None) == 0, "epoll_pwait2: timeout, nothing")
    ep.close()

    # EPOLLEXCLUSIVE: at ADD only, with IN/OUT/ERR/HUP/ET; not modifiable.
    ep = select.epoll()
    ep.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
    try:
        ep.modify(fd, select.EPOLLIN)
        check(False, "EPOLLEXCLUSIVE registration: MOD fails with EINVAL")
    except OSError as e:
        check(e.errno == errno.EINVAL, "EPOLLEXCLUSIVE registration: MOD fails with EINVAL")
    ep.unregister(fd)
    try:
        ep.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE | select.EPOLLONESHOT)
        check(False, "EPOLLEXCLUSIVE with EPOLLONESHOT: EINVAL")
    except OSError as e:
        check(e.errno == errno.EINVAL, "EPOLLEXCLUSIVE with EPOLLONESHOT: EINVAL")
    ep.close()

    # close_range forgets the numbers it closes: a pipe that reuses one is a pipe.
    d2 = os.dup(fd)
    os.closerange(d2, d2 + 1)
    r2, w2 = os.pipe()
    os.set_blocking(r2, False)
    os.write(w2, b"p")
    try:
        got = os.read(r2, 1)
    except OSError as e:
        got = repr(e)
    check(r2 != d2 or got == b"p", f"close_range: the reused number {r2} is a pipe ({got!r})")
    for x in (r, w, r2, w2):
        os.close(x)

    # Urgent data (MSG_OOB), as TCP without SO_OOBINLINE: the last byte sent with MSG_OOB is
    # out of band (POLLPRI, recv(MSG_OOB)), the others in line; SIOCATMARK at the mark.
    ask(conn, "oob abc")
    _, _, xl = select.select([], [], [fd], 5)
    check(xl == [fd], "urgent data: exceptional condition (POLLPRI)")
    check(conn.recv(1, socket.MSG_OOB | socket.MSG_PEEK) == b"c", "recv(MSG_OOB|MSG_PEEK): the urgent byte")
    check(conn.recv(1, socket.MSG_OOB) == b"c", "recv(MSG_OOB) before the bytes in front of it")
    check(conn.recv(10) == b"ab", "the bytes in front of the urgent byte, in line")
    try:
        conn.recv(1, socket.MSG_OOB)
        check(False, "recv(MSG_OOB) once the urgent byte was read: EINVAL")
    except OSError as e:
        check(e.errno == errno.EINVAL, "recv(MSG_OOB) once the urgent byte was read: EINVAL")
    ask(conn, "oob xyz")
    select.select([], [], [fd], 5)
    check(conn.recv(10) == b"xy", "a read stops in front of the urgent byte")
    mark = struct.unpack("i", fcntl.ioctl(fd, 0x8905, struct.pack("i", 0)))[0]  # SIOCATMARK
    check(mark == 1, f"SIOCATMARK at the mark ({mark})")
    check(conn.recv(1, socket.MSG_OOB) == b"z", "recv(MSG_OOB) at the mark")
    ask(conn, "send 2 q")
    check(wait_readable(conn) and conn.recv(10) == b"qq", "the urgent byte is not in line")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE, 1)
    ask(conn, "oob mn")
    got = b""
    while len(got) < 2 and wait_readable(conn):
        got += conn.recv(10)
    check(got == b"mn", f"SO_OOBINLINE: the urgent byte in line ({got!r})")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE, 0)
    ask(conn, "oobrecv")
    conn.send(b"Q", socket.MSG_OOB)
    line = conn.makefile("rb").readline()
    check(line == b"oob Q\n", f"the client got the urgent byte out of band ({line!r})")

    # posix_spawn: a program started with the connection inherited asks this process, the
    # connection's owner, for a relay and reads the byte the peer sent; this process keeps
    # using the connection (relayed from then on).
    ask(conn, "send 1 p")
    os.set_inheritable(fd, True)
    code = "import os,sys\ntry:\n print('read', os.read(int(sys.argv[1]),1).decode())\nexcept OSError as e: print(e.errno)"
    rp, wp = os.pipe()
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code, str(fd)], os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, wp, 1)])
    os.close(wp)
    os.set_inheritable(fd, False)
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    out = os.read(rp, 100).strip()
    os.close(rp)
    check(out == b"read p", f"posix_spawn: the new program reads the inherited connection, relayed ({out!r})")
    ask(conn, "send 3 k")
    check(wait_readable(conn) and conn.recv(3) == b"kkk", "the connection still works after posix_spawn")

    # execvpe, fexecve, the list forms (execl's list long enough to pass some of it on the
    # stack, execlp's only in registers, execle's environment after a long list) and a raw
    # SYS_execve in a forked child: the new program asks this process for a relay and reads
    # the byte the peer sent.
    for how, byte in zip(("execvpe", "fexecve", "execl", "execlp", "execle", "SYS_execve"), "abcdef"):
        ask(conn, f"send 1 {byte}")
        rp, wp = os.pipe()
        os.set_inheritable(fd, True)
        pid = os.fork()
        if pid == 0:
            os.dup2(wp, 1)
            argv = (ctypes.c_char_p * 5)(sys.executable.encode(), b"-c", code.encode(),
                                         str(fd).encode(), None)
            env = [f"{k}={v}".encode() for k, v in os.environ.items()]
            envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)
            exe = sys.executable.encode()
            # Extra arguments the program ignores: seven list entries put three on the stack.
            longer = [exe, b"-c", code.encode(), str(fd).encode(), b"x", b"y", b"z"]
            if how == "execvpe":
                libc.execvpe(exe, argv, envp)
            elif how == "fexecve":
                libc.fexecve(os.open(sys.executable, os.O_RDONLY), argv, envp)
            elif how == "execl":
                libc.execl(exe, *longer, None)
            elif how == "execlp":
                libc.execlp(os.path.basename(exe), exe, b"-c", code.encode(), str(fd).encode(), None)
            elif how == "execle":
                libc.execle(exe, *longer, None, envp)
            else:
                libc.syscall(59 if os.uname().machine == "x86_64" else 221, exe, argv, envp)
            os._exit(127)
        os.close(wp)
        os.set_inheritable(fd, False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        out = os.read(rp, 100).strip()
        os.close(rp)
        check(out == f"read {byte}".encode(), f"{how} in a child: the new program reads the inherited connection, relayed ({out!r})")
    # The execs above named the connection to the new programs in their own environments;
    # this process's environment (shared with a vfork child until its exec) stays as it was.
    libc.getenv.restype = ctypes.c_char_p
    check(libc.getenv(b"SMC_PRELOAD_INHERITED") is None, "the children's execs left this environment alone")


def self_connect_checks(port):
    """Connections to a listener of this very process: connect returns before any accept
    (as TCP's backlog lets it), then the bytes flow once accepted."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # (On the unspecified address: the library recognises its port on a local address.)
    ls.bind(("0.0.0.0", port))
    ls.listen(4)
    # One thread: connect and write, then accept and read; a blocking and a nonblocking
    # connect.
    for blocking in (True, False):
        c = socket.socket()
        c.settimeout(10)
        c.setblocking(blocking)
        rc = c.connect_ex(("127.0.0.1", port))
        check(rc in (0, errno.EINPROGRESS), f"self-connect (blocking={blocking}) returns before accept ({rc})")
        if not blocking:
            check(bool(select.select([], [c], [], 10)[1]), "self-connect: writable before accept")
            check(c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "self-connect: SO_ERROR = 0")
        c.setblocking(True)
        c.settimeout(10)
        c.sendall(b"before accept")
        a, _ = ls.accept()
        a.settimeout(10)
        got = b""
        while len(got) < 13:
            chunk = a.recv(13 - len(got))
            if not chunk:
                break
            got += chunk
        check(got == b"before accept", f"self-connect: bytes written before accept arrive ({got!r})")
        a.sendall(b"reply")
        check(c.recv(5) == b"reply", "self-connect: the accepted end answers")
        # These stayed TCP: urgent data out of band, as the program left SO_OOBINLINE (off).
        check(c.getsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE) == 0
              and a.getsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE) == 0,
              "self-connect (TCP): SO_OOBINLINE as the program left it")
        c.send(b"x!", socket.MSG_OOB)
        select.select([], [], [a], 10)
        check(a.recv(1, socket.MSG_OOB) == b"!" and a.recv(10) == b"x",
              "self-connect (TCP): the urgent byte out of band")
        a.close()
        c.close()
    # Another thread accepts at once and serves: the bytes flow both ways.
    def serve():
        a, _ = ls.accept()
        a.sendall(a.recv(100).upper())
        a.close()

    t = threading.Thread(target=serve)
    t.start()
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(b"threaded")
    check(c.recv(100) == b"THREADED", "self-connect with an accepting thread")
    t.join(10)
    c.close()
    ls.close()


def client(port, smc):
    s = socket.socket()
    s.setblocking(False)
    # Registered in epoll before connect (as nginx does for upstream sockets): the
    # registration must follow the socket to SMC-R.
    early = select.epoll()
    early.register(s.fileno(), select.EPOLLIN)
    rc = s.connect_ex(("127.0.0.1", port))
    check(rc in (0, errno.EINPROGRESS), f"nonblocking connect: 0 or EINPROGRESS ({rc})")
    p = select.poll()
    p.register(s, select.POLLOUT)
    check(bool(p.poll(5000)), "POLLOUT once connected")
    check(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "SO_ERROR = 0")
    s.setblocking(True)
    mode = smc_mode_of_pid(smc, os.getpid(), port)
    check(mode == "SMC-R", f"client side is SMC-R (smc ss says {mode})")
    ev = early.poll(5)
    check(ev == [(s.fileno(), select.EPOLLIN)], f"epoll registration made before connect reports data ({ev})")
    f = s.makefile("rb")
    while True:
        line = f.readline()
        if not line:
            break
        cmd = line.decode().split()
        if cmd[0] == "send":
            s.sendall(cmd[2].encode() * int(cmd[1]))
        elif cmd[0] == "seq":
            s.sendall(bytes(i * 7 % 251 for i in range(int(cmd[1]))))
        elif cmd[0] == "expect":
            got = f.readline()
            check(got == (cmd[1] + "\n").encode(), f"got {cmd[1]} ({got!r})")
        elif cmd[0] == "recv":
            n, want = int(cmd[1]), cmd[2]
            buf = b""
            while len(buf) < n:
                chunk = f.read1(n - len(buf)) if hasattr(f, "read1") else f.read(n - len(buf))
                if not chunk:
                    break
                buf += chunk
            ok = hashlib.sha256(buf).hexdigest() == want
            check(ok, "sendfile payload")
            s.sendall(b"recv ok\n" if ok else b"recv bad\n")
        elif cmd[0] == "oob":
            s.send(cmd[1].encode(), socket.MSG_OOB)
        elif cmd[0] == "oobrecv":
            select.select([], [], [s], 5)
            b = s.recv(1, socket.MSG_OOB)
            s.sendall(b"oob " + b + b"\n")
        elif cmd[0] == "echo":
            left = int(cmd[1])
            while left:
                chunk = f.read1(min(left, 65536))
                if not chunk:
                    break
                s.sendall(chunk)
                left -= len(chunk)
        elif cmd[0] == "shutdown":
            s.shutdown(socket.SHUT_WR)
    s.close()
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    role, port, smc = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    (server if role == "server" else client)(port, smc)
