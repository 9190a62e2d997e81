#!/usr/bin/env python3
"""An SMC-R connection passed to another process with SCM_RIGHTS after the server read its
request (docs/preload.md, "SCM_RIGHTS"): the receiver serves it, relayed through the owner.

    preload-passfd.py server PORT SMC   (under `smc run`: accepts, reads the request line,
                                         passes the connection to a worker, closes its copy)
    preload-passfd.py client PORT SMC   (under `smc run`: the scenarios; exits 0 or 1)
    preload-passfd.py worker PATH       (started by the server, detached: an unrelated
                                         process that takes connections on unix socket PATH)

Three workers: one forked by the server before its first accept (a socketpair), one exec'd
apart from it (double fork: not the server's child) that connects to a named unix socket,
and a forked one on a SOCK_SEQPACKET socketpair that the server sends to with `sendmmsg` and
that receives with `recvmmsg` (both through ctypes: Python has neither).
Scenarios, one connection each (SHA-256 of every payload compared both ways, the client's
connection listed as SMC-R by `smc ss`):

1. fork: the request line and 1 MB behind it; the forked worker reads the 1 MB and answers
   with 4 MiB, then closes: the client reads the answer and the end of stream.
2. exec: the same through the exec'd worker.
3. fork-busy: data in flight both ways at the pass: the client writes 3 MB from a thread
   while the server, after the request line, writes 512 KiB the client has not read yet and
   then passes the connection; the worker reads the 3 MB and answers with 4 MiB.
4. exec-busy: the same through the exec'd worker.
5. fork-exit: the forked worker takes the connection and exits without using it: the
   connection ends (the client reads the end of stream, or a reset), as TCP's when the last
   holder closes.
6. exec-exit: the same with the exec'd worker.
7. fork-on: passed on by a process that is not the owner: the forked worker reads the first
   half of the client's 2 MB (relayed), sends the connection back to the server, which
   received its own connection and, half a second later, passes it on to the exec'd
   worker; that one reads the
   second half, in order, and answers.
8. mmsg: as 1, the connection passed with `sendmmsg` (two messages: a greeting without
   descriptors, then the connection) and received with `recvmmsg`.
9. exec-squat: as 2, with the connection's pass name (`smc-rs-passed/<dev>/<ino>`) bound
   first by a process of another user (uid 65534, without the library): the owner binds a
   name under it, the receiver refuses the squatter's server and finds the owner's.
10. mmsg-failed: as 5 through the mmsg worker, after a `sendmsg` of the connection that
   failed (EAGAIN: a unix socket whose queue is full): the failed send is no pass, so the
   connection is not kept for it (`SMC_PASS_WAIT_MS`, 60 s, longer than the client's 30 s
   wait) and ends when the worker exits.
"""
import ctypes
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

FAILED = []
ANSWER = 4 << 20


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def sha(b):
    return hashlib.sha256(b).hexdigest()


def line_of(s):
    b = b""
    while not b.endswith(b"\n"):
        c = s.recv(1)
        if not c:
            break
        b += c
    return b.decode().strip()


def read_exact(s, n):
    out = bytearray()
    while len(out) < n:
        b = s.recv(min(n - len(out), 1 << 16))
        if not b:
            break
        out += b
    return bytes(out)


# ---------------------------------------------------------------- workers


def serve(c, mode, n, u):
    """A worker's part: read the client's n bytes, answer with their SHA-256, the answer's
    and the answer (4 MiB), then close."""
    if mode == "exit":
        os._exit(0)
    if mode == "on":
        read_exact(c, n // 2)
        socket.send_fds(u, [b"back"], [c.fileno()])
        c.close()
        return
    got = read_exact(c, n)
    data = os.urandom(ANSWER)
    c.sendall(f"{sha(got)} {len(got)} {sha(data)}\n".encode() + data)
    c.close()


def worker_loop(u, mmsg=False):
    """Take connections from unix socket u: a line `MODE N` with the connection attached
    (with `recvmmsg` when mmsg; a message without a descriptor is a greeting)."""
    while True:
        if mmsg:
            got = recv_mmsg(u)
        else:
            msg, fds, _, _ = socket.recv_fds(u, 100, 1)
            got = [(msg, fds)]
        for msg, fds in got:
            if not msg:
                return
            if not fds:
                continue
            mode, n = msg.decode().split()
            c = socket.socket(fileno=fds[0])
            serve(c, mode, int(n), u)


# ---------------------------------------------------------------- sendmmsg/recvmmsg

LIBC = ctypes.CDLL(None, use_errno=True)
SOL_SOCKET, SCM_RIGHTS, MSG_WAITFORONE = 1, 1, 0x10000


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(Iovec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", Msghdr), ("len", ctypes.c_uint)]


class Cmsg1(ctypes.Structure):
    """A control message with one descriptor (CMSG_SPACE(4) = 24 bytes on 64-bit Linux)."""
    _fields_ = [("len", ctypes.c_size_t), ("level", ctypes.c_int), ("type", ctypes.c_int),
                ("fd", ctypes.c_int), ("pad", ctypes.c_int)]


def send_mmsg(u, msgs):
    """sendmmsg on u of [(bytes, fd or None)], all in one call; returns how many went."""
    keep = []
    v = (Mmsghdr * len(msgs))()
    for i, (data, fd) in enumerate(msgs):
        buf = ctypes.create_string_buffer(data, len(data))
        iov = Iovec(ctypes.cast(buf, ctypes.c_void_p), len(data))
        keep += [buf, iov]
        v[i].hdr.iov = ctypes.pointer(iov)
        v[i].hdr.iovlen = 1
        if fd is not None:
            c = Cmsg1(20, SOL_SOCKET, SCM_RIGHTS, fd, 0)
            keep.append(c)
            v[i].hdr.control = ctypes.cast(ctypes.pointer(c), ctypes.c_void_p)
            v[i].hdr.controllen = ctypes.sizeof(c)
    n = LIBC.sendmmsg(u.fileno(), v, len(msgs), 0)
    if n < 0:
        raise OSError(ctypes.get_errno(), "sendmmsg")
    return n


def recv_mmsg(u):
    """recvmmsg on u of up to two messages (the first waited for): [(bytes, [fd])]."""
    v = (Mmsghdr * 2)()
    bufs, iovs, cms = [], [], []
    for i in range(2):
        bufs.append(ctypes.create_string_buffer(100))
        iovs.append(Iovec(ctypes.cast(bufs[i], ctypes.c_void_p), 100))
        cms.append(Cmsg1())
        v[i].hdr.iov = ctypes.pointer(iovs[i])
        v[i].hdr.iovlen = 1
        v[i].hdr.control = ctypes.cast(ctypes.pointer(cms[i]), ctypes.c_void_p)
        v[i].hdr.controllen = ctypes.sizeof(cms[i])
    n = LIBC.recvmmsg(u.fileno(), v, 2, MSG_WAITFORONE | socket.MSG_CMSG_CLOEXEC, None)
    if n < 0:
        raise OSError(ctypes.get_errno(), "recvmmsg")
    out = []
    for i in range(n):
        has = v[i].hdr.controllen >= 20 and cms[i].level == SOL_SOCKET and cms[i].type == SCM_RIGHTS
        out.append((bufs[i].raw[:v[i].len], [cms[i].fd] if has else []))
    return out


# The squatter (run as `python3 -c SQUAT NAME`: another user may not read this file): bind and
# listen on abstract name NAME, say so, and hold it until stdin ends.
SQUAT = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\\0" + sys.argv[1])
s.listen(4)
print(f"ready {os.getuid()}", flush=True)
sys.stdin.read()
"""


def worker(path):
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(200):
        try:
            u.connect(path)
            break
        except OSError:
            time.sleep(0.05)
    worker_loop(u)


# ---------------------------------------------------------------- server


def start_exec_worker(path):
    """The exec'd worker, detached (its parent exits at once: it is not the server's child)."""
    pid = os.fork()
    if pid == 0:
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", path],
                         start_new_session=True)
        os._exit(0)
    os.waitpid(pid, 0)


def server(port):
    path = f"/tmp/smc-passfd-{port}.sock"
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    ul = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ul.bind(path)
    ul.listen(1)
    start_exec_worker(path)
    to_exec, _ = ul.accept()
    ul.close()
    os.unlink(path)
    # The forked worker: made before the first accept, it holds no connection of the server.
    to_fork, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        to_fork.close()
        worker_loop(theirs)
        os._exit(0)
    theirs.close()
    # The third worker, forked too: sendmmsg/recvmmsg over a SOCK_SEQPACKET socketpair.
    to_mmsg, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mpid = os.fork()
    if mpid == 0:
        to_mmsg.close()
        to_fork.close()
        to_exec.close()
        worker_loop(theirs, mmsg=True)
        os._exit(0)
    theirs.close()
    # A unix socket whose queue is full: a send of a connection on it fails (EAGAIN).
    jam, jam_peer = socket.socketpair()
    jam.setblocking(False)
    try:
        while True:
            jam.send(b"j" * 65536)
    except BlockingIOError:
        pass
    squatters = []
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    while True:
        c, _ = ls.accept()
        cmd = line_of(c).split()
        if not cmd or cmd[0] == "quit":
            c.close()
            break
        # e.g. "fork-busy 3000000": to the forked worker, 512 KiB written first.
        where, _, mode = cmd[0].partition("-")
        n = cmd[1]
        if mode == "busy":
            c.sendall(b"s" * (512 << 10))
        if mode == "failed":
            try:
                socket.send_fds(jam, [b"exit 0"], [c.fileno()])
                print("FAIL server: a send on the full socket went", flush=True)
            except BlockingIOError:
                pass
            mode = "exit"
        if mode == "squat":
            squatters.append(start_squatter(c))
            mode = "serve"
        if where == "mmsg":
            sent = send_mmsg(to_mmsg, [(b"hello", None), (f"{mode or 'serve'} {n}".encode(), c.fileno())])
            if sent != 2:
                print(f"FAIL server: sendmmsg sent {sent} of 2", flush=True)
        else:
            u = to_fork if where == "fork" else to_exec
            socket.send_fds(u, [f"{mode or 'serve'} {n}".encode()], [c.fileno()])
        c.close()
        if mode == "on":
            # The worker sends it back after the first half: on to the exec'd worker.
            _, fds, _, _ = socket.recv_fds(to_fork, 100, 1)
            back = socket.socket(fileno=fds[0])
            # A while with the connection back in the owner's hands alone (its program's own
            # entry holds it: a pass brought it back after its close).
            time.sleep(0.5)
            socket.send_fds(to_exec, [f"serve {int(n) - int(n) // 2}".encode()], [back.fileno()])
            back.close()
    to_fork.close()
    to_exec.close()
    to_mmsg.close()
    jam.close()
    jam_peer.close()
    for q in squatters:
        q.stdin.close()
        q.wait()
    os.waitpid(pid, 0)
    os.waitpid(mpid, 0)
    print("ok   server done", flush=True)


def start_squatter(c):
    """A process of uid 65534 without the library that binds the pass name of connection c
    (`smc-rs-passed/<dev>/<ino>` of its TCP socket) before the server passes it."""
    st = os.fstat(c.fileno())
    name = f"smc-rs-passed/{st.st_dev}/{st.st_ino}"
    q = subprocess.Popen(["env", "-u", "LD_PRELOAD", "setpriv", "--reuid=65534", "--regid=65534",
                          "--clear-groups", sys.executable, "-c", SQUAT, name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = q.stdout.readline().split()
    if line != ["ready", "65534"]:
        print(f"FAIL server: the squatter did not bind {name}: {line}", flush=True)
    return q


# ---------------------------------------------------------------- client


def mode_of(smc, port):
    out = subprocess.run([smc, "ss", "--json"], capture_output=True, text=True, check=True).stdout
    for st in json.loads(out):
        if st["pid"] == str(os.getpid()):
            for s in st["ss"]:
                if s.get("peer", "").endswith(f":{port}"):
                    return s.get("mode")
    return None


def scenario(port, smc, name, n, busy):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    data = os.urandom(n)
    mode = mode_of(smc, port)
    if busy:
        s.sendall(f"{name} {n}\n".encode())
        w = threading.Thread(target=s.sendall, args=(data,))
        w.start()
        early = read_exact(s, 512 << 10)
        check(early == b"s" * (512 << 10), f"{name}: the server's 512 KiB before the pass")
    else:
        s.sendall(f"{name} {n}\n".encode() + data)
    try:
        head = line_of(s).split()
        answer = read_exact(s, ANSWER)
        end = s.recv(1)
    except OSError as e:
        check(False, f"{name}: the worker's answer ({e!r})")
        s.close()
        return
    if busy:
        w.join()
    if name.endswith("-on"):
        data = data[n // 2:]
    check(head[:2] == [sha(data), str(len(data))],
          f"{name}: the worker read the client's {len(data)} bytes in order")
    check(len(head) == 3 and sha(answer) == head[2] and len(answer) == ANSWER,
          f"{name}: the client read the worker's {len(answer)} bytes in order")
    check(end == b"", f"{name}: then the end of stream")
    check(mode == "SMC-R", f"{name}: smc ss lists the connection as SMC-R ({mode})")
    s.close()


def scenario_exit(port, smc, name):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    mode = mode_of(smc, port)
    s.sendall(f"{name} 0\n".encode())
    t = time.monotonic()
    try:
        got = s.recv(10)
        how = "end of stream" if got == b"" else f"data {got!r}"
    except ConnectionResetError:
        how = "reset"
    except OSError as e:
        how = repr(e)
    check(how in ("end of stream", "reset"),
          f"{name}: the worker exited without using it: the client sees {how} "
          f"after {time.monotonic() - t:.1f} s")
    check(mode == "SMC-R", f"{name}: smc ss lists the connection as SMC-R ({mode})")
    s.close()


def client(port, smc):
    for name in ("fork", "exec"):
        scenario(port, smc, name, 1_000_000, False)
    for name in ("fork-busy", "exec-busy"):
        scenario(port, smc, name, 3_000_000, True)
    scenario(port, smc, "fork-on", 2_000_000, False)
    scenario(port, smc, "mmsg", 1_000_000, False)
    scenario(port, smc, "exec-squat", 1_000_000, False)
    # (The workers exit in these.)
    scenario_exit(port, smc, "mmsg-failed")
    for name in ("fork-exit", "exec-exit"):
        scenario_exit(port, smc, name)
    q = socket.create_connection(("127.0.0.1", port))
    q.sendall(b"quit\n")
    q.close()
    if FAILED:
        print(f"{len(FAILED)} failed", flush=True)
        sys.exit(1)
    print("ok   all scenarios", flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "worker":
        worker(sys.argv[2])
    elif role == "server":
        server(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), sys.argv[3])
