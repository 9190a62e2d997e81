#!/usr/bin/env python3
"""A connection set up by one process and then used by a forked child as well (docs/preload.md,
"Connections shared by processes"): both processes read and write it, as TCP lets them.

    preload-fork.py server PORT SMC   (under `smc run`: serves the client's connections)
    preload-fork.py client PORT SMC   (under `smc run`: the scenarios; exits 0 or 1)

Scenarios, one connection each (SHA-256 of every payload compared):

1. rsync's pattern at both ends: the client's child reads the echo while the parent writes
   8 MB; the server's child reads the requests while its parent writes the echo (the two
   server processes pass the bytes through a pipe). Then both client processes see the end
   of stream, and `smc ss` lists the connection as SMC-R in the client's stack.
2. The reverse: the child writes 8 MB and closes first; the parent, blocked in a read on its
   number when the child's first use relays the connection, reads the echo to the end, in
   order.
3. Hand-off: the child reads the first 1 MB of a 3 MB answer and exits; the parent reads the
   rest, none lost or reordered.
4. The child waits with epoll (nonblocking socket, EPOLLIN|EPOLLOUT), writing 4 MB while
   reading the echo; then the parent uses poll and select on its number.
5. The parent closes its number after the child's first use; the child goes on (2 MB echo)
   and sees the end of stream.
6. The owner exits first: a child connects, forks a grandchild that uses the connection,
   then exits (the library keeps the relay going until the grandchild is done); the
   grandchild goes on (2 MB echo).
7. The parent sleeps in poll on its number when the child's first use relays the
   connection: the poll wakes for the echo that now arrives through the relay.
8. The peer resets the connection after an answer: the child reads the answer, then
   ECONNRESET once and end of stream; the parent reads end of stream, and its write EPIPE.
9. A forked child execs a program (python3 -c) with the connection as its standard input
   and output: the new image asks the owner for a relay, writes 3 MB, shuts down and reads
   the echo to the end; the parent then reads the end of stream too.
10. The parent closes its number right after the fork (socat's and inetd's way), before the
   child's first use; the child execs `cat` with the connection as its standard input (3 MB
   read to the end, into a file). The connection is kept for the child, and its exit ends
   the connection: the server reads the end of stream (asked afterwards: "last").
11. The same with a forked child that uses the connection itself (2 MB echo), then closes
   it without a shutdown: the server reads the end of stream.
"""
import errno
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time

FAILED = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def line_of(s):
    b = b""
    while not b.endswith(b"\n"):
        c = s.recv(1)
        if not c:
            break
        b += c
    return b.decode().strip()


def read_all(s):
    h = hashlib.sha256()
    n = 0
    while True:
        b = s.recv(1 << 16)
        if not b:
            return h.hexdigest(), n
        h.update(b)
        n += len(b)


def read_exact(s, n):
    out = bytearray()
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            break
        out += b
    return bytes(out)


def sha(b):
    return hashlib.sha256(b).hexdigest()


# ---------------------------------------------------------------- server


def echo(c):
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        c.sendall(b)
    c.shutdown(socket.SHUT_WR)


def split_echo(c):
    """The server's own fork: the child reads the connection into a pipe, the parent writes
    what the pipe brings back to the connection (rsync's receiver/generator split)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            os.write(w, b)
        os._exit(0)
    os.close(w)
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        c.sendall(b)
    c.shutdown(socket.SHUT_WR)
    os.waitpid(pid, 0)


def server(port):
    last = "none"  # how the last echo or send connection ended, for "last"
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
        if cmd[0] == "last":
            c.sendall(last.encode() + b"\n")
        elif cmd[0] == "echo":
            echo(c)
            last = "end of stream"
        elif cmd[0] == "split-echo":
            split_echo(c)
        elif cmd[0] == "reset":
            # Answer, then close with the client's bytes unread: a reset (TCP: a RST,
            # SMC-R: a PeerConnAbort).
            c.recv(1, socket.MSG_PEEK)
            c.sendall(b"answer")
            time.sleep(0.2)
        elif cmd[0] == "send":
            data = os.urandom(int(cmd[1]))
            c.sendall(sha(data).encode() + b"\n" + data)
            c.shutdown(socket.SHUT_WR)
            read_all(c)
            last = "end of stream"
        c.close()
    print("ok   server done", flush=True)


# ---------------------------------------------------------------- client


def mode_of(smc, pid, port):
    out = subprocess.run([smc, "ss", "--json"], capture_output=True, text=True, check=True).stdout
    for st in json.loads(out):
        if st["pid"] == str(pid):
            for s in st["ss"]:
                if s.get("peer", "").endswith(f":{port}"):
                    return s.get("mode")
    return None


def child_result(pid, r):
    """The child's report (one line through pipe r) and its exit status."""
    got = b""
    while True:
        b = os.read(r, 1000)
        if not b:
            break
        got += b
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return got.decode().strip(), status


def in_child(fn):
    """Run fn() in a forked child; its return value (a string) comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except Exception as e:  # reported to the parent as the result
            out = f"error {e!r}"
        os.write(w, out.encode() + b"\n")
        os._exit(0)
    os.close(w)
    return pid, r


def scenario_rsync(port, smc):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"split-echo\n")
    data = os.urandom(8_000_000)
    pid, r = in_child(lambda: "%s %d" % read_all(s))
    s.sendall(data)
    mode = mode_of(smc, os.getpid(), port)
    s.shutdown(socket.SHUT_WR)
    got, status = child_result(pid, r)
    check(got == f"{sha(data)} {len(data)}" and status == 0,
          f"1: the child read the 8 MB echo of what the parent wrote ({got[:30]}…, status {status})")
    check(s.recv(10) == b"", "1: the parent sees the end of stream too")
    check(mode == "SMC-R", f"1: smc ss lists the connection as SMC-R in the parent's stack ({mode})")
    s.close()


def scenario_reverse(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\n")
    data = os.urandom(8_000_000)

    def child():
        time.sleep(0.3)  # the parent is blocked in its read by now
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        s.close()
        return "sent"
    pid, r = in_child(child)
    got = read_all(s)
    res, status = child_result(pid, r)
    check(res == "sent" and status == 0, f"2: the child wrote 8 MB and closed ({res})")
    check(got == (sha(data), len(data)), f"2: the parent read the whole echo to the end ({got[1]} bytes)")
    s.close()


def scenario_handoff(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"send 3000000\n")
    want = line_of(s)
    pid, r = in_child(lambda: read_exact(s, 1_000_000).hex())
    res, status = child_result(pid, r)
    first = bytes.fromhex(res) if not res.startswith("error") else b""
    rest = bytearray()
    while True:
        b = s.recv(1 << 16)
        if not b:
            break
        rest += b
    check(len(first) == 1_000_000 and status == 0, f"3: the child read the first 1 MB ({len(first)})")
    check(sha(first + rest) == want, f"3: the parent read the other {len(rest)} bytes, nothing lost or reordered")
    s.close()


def scenario_epoll(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\n")
    data = os.urandom(4_000_000)

    def child():
        s.setblocking(False)
        ep = select.epoll()
        ep.register(s.fileno(), select.EPOLLIN | select.EPOLLOUT)
        sent, h, n, shut = 0, hashlib.sha256(), 0, False
        while True:
            for _, ev in ep.poll(10):
                if ev & select.EPOLLOUT and sent < len(data):
                    try:
                        sent += s.send(data[sent:sent + (1 << 16)])
                    except BlockingIOError:
                        pass
                    if sent == len(data) and not shut:
                        s.shutdown(socket.SHUT_WR)
                        ep.modify(s.fileno(), select.EPOLLIN)
                        shut = True
                if ev & (select.EPOLLIN | select.EPOLLHUP):
                    try:
                        b = s.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    if not b:
                        return "%s %d" % (h.hexdigest(), n)
                    h.update(b)
                    n += len(b)
    pid, r = in_child(child)
    res, status = child_result(pid, r)
    check(res == f"{sha(data)} {len(data)}" and status == 0,
          f"4: the child's epoll loop wrote 4 MB and read the echo to the end ({res[:30]}…)")
    # The parent's number, on the same (nonblocking, as the child left the shared file
    # description) socket: poll and select report the end of stream.
    p = select.poll()
    p.register(s, select.POLLIN)
    ev = p.poll(5000)
    check(bool(ev) and ev[0][1] & select.POLLIN, f"4: poll in the parent reports the end of stream ({ev})")
    rl, _, _ = select.select([s], [], [], 5)
    check(rl == [s], "4: select in the parent too")
    check(s.recv(10) == b"", "4: and the parent reads it")
    s.close()


def scenario_parent_closes(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\n")
    data = os.urandom(2_000_000)
    go_r, go_w = os.pipe()

    def child():
        s.sendall(b"ping")
        first = read_exact(s, 4)
        os.write(go_w, b"x")
        os.close(go_w)
        # (The parent closes its number now.)
        time.sleep(0.3)
        import threading
        t = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
        t.start()
        got = read_all(s)
        t.join()
        return "%s %s %d" % (first.decode(), got[0], got[1])
    pid, r = in_child(child)
    os.close(go_w)
    os.read(go_r, 1)
    os.close(go_r)
    s.close()
    res, status = child_result(pid, r)
    check(res == f"ping {sha(data)} {len(data)}" and status == 0,
          f"5: after the parent closed its number, the child's 2 MB echo and end of stream ({res[:40]}…)")


def scenario_owner_exits(port):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # The owner: connects, lets a grandchild use the connection, then exits normally.
        os.close(r)
        used_r, used_w = os.pipe()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"echo\n")
        s.sendall(b"ping")
        gpid = os.fork()
        if gpid == 0:
            os.close(used_r)
            data = os.urandom(2_000_000)
            try:
                first = read_exact(s, 4)
                os.write(used_w, b"x")
                os.close(used_w)
                time.sleep(0.5)  # the owner exits meanwhile
                import threading
                t = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
                t.start()
                got = read_all(s)
                t.join()
                out = "%s %s" % (first.decode(), "same" if got == (sha(data), len(data)) else "differs")
            except Exception as e:
                out = f"error {e!r}"
            os.write(w, out.encode() + b"\n")
            os._exit(0)
        os.close(used_w)
        os.read(used_r, 1)
        sys.exit(0)  # through the library's destructor
    os.close(w)
    os.waitpid(pid, 0)
    got = b""
    while True:
        b = os.read(r, 1000)
        if not b:
            break
        got += b
    os.close(r)
    check(got.decode().strip() == "ping same",
          f"6: the owner exited; its grandchild's 2 MB echo went on ({got.decode().strip()})")


def scenario_poll_asleep(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\n")
    s.sendall(b"warm")
    check(read_exact(s, 4) == b"warm", "7: the parent's own echo first (the connection set up here)")

    def child():
        time.sleep(0.3)  # the parent sleeps in poll by now
        s.sendall(b"hello")
        return "sent"
    pid, r = in_child(child)
    p = select.poll()
    p.register(s, select.POLLIN)
    t0 = time.monotonic()
    ev = p.poll(10000)
    waited = time.monotonic() - t0
    got = s.recv(100) if ev else b""
    res, status = child_result(pid, r)
    check(ev and got == b"hello" and waited < 5,
          f"7: a poll asleep on the connection when the child's first use relayed it wakes for the echo ({ev}, {got!r}, {waited:.1f} s)")
    s.shutdown(socket.SHUT_WR)
    check(s.recv(10) == b"", "7: end of stream")
    s.close()


def scenario_reset(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"reset\nunread")

    def child():
        got, err = b"", None
        while True:
            try:
                b = s.recv(100)
            except OSError as e:
                err = e.errno
                break
            if not b:
                break
            got += b
        after = s.recv(100)
        return "%s %s %r" % (got.decode(), err, after)
    pid, r = in_child(child)
    res, status = child_result(pid, r)
    check(res == "answer %d b''" % errno.ECONNRESET,
          f"8: the peer's reset reaches the child after the answer: ECONNRESET once, then end of stream ({res})")
    check(s.recv(10) == b"", "8: the parent reads end of stream after it")
    try:
        s.send(b"x")
        wrote = "sent"
    except OSError as e:
        wrote = errno.errorcode.get(e.errno, str(e.errno))
    check(wrote == "EPIPE", f"8: the parent's write gets EPIPE ({wrote})")
    s.close()


# The program a forked child execs in scenario 9: the connection is its standard input and
# output; it writes the file argv[1] (the first bytes alone: one first use, by one thread),
# shuts down, reads the echo to the end and writes "SHA-256 length" into argv[2].
EXEC_ECHO = r"""
import hashlib, os, socket, sys, threading
data = open(sys.argv[1], "rb").read()
os.write(1, data[:5])
def w():
    off = 5
    while off < len(data):
        off += os.write(1, data[off:off + 65536])
    socket.socket(fileno=os.dup(1)).shutdown(socket.SHUT_WR)
t = threading.Thread(target=w)
t.start()
h, n = hashlib.sha256(), 0
while True:
    b = os.read(0, 65536)
    if not b:
        break
    h.update(b)
    n += len(b)
t.join()
open(sys.argv[2], "w").write("%s %d" % (h.hexdigest(), n))
"""


def scenario_exec(port, tmp):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\nwarm")
    check(read_exact(s, 4) == b"warm", "9: the parent's own echo first (the connection set up here)")
    data = os.urandom(3_000_000)
    src, out = os.path.join(tmp, "exec-in"), os.path.join(tmp, "exec-out")
    with open(src, "wb") as f:
        f.write(data)
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(s.fileno(), 0)
            os.dup2(s.fileno(), 1)
            os.execv(sys.executable, [sys.executable, "-c", EXEC_ECHO, src, out])
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    res = open(out).read() if os.path.exists(out) else "no result"
    check(res == f"{sha(data)} {len(data)}" and status == 0,
          f"9: an exec'd program (the connection as stdin and stdout) wrote 3 MB and read the echo to the end ({res[:30]}…, status {status})")
    check(s.recv(10) == b"", "9: the parent reads the end of stream after it")
    s.close()


def last_end(port):
    """How the server saw the previous connection end (it serves one at a time: a connection
    nobody ends keeps it from answering)."""
    q = socket.create_connection(("127.0.0.1", port))
    q.settimeout(10)
    try:
        q.sendall(b"last\n")
        return line_of(q)
    except OSError as e:
        return f"no answer ({e})"
    finally:
        q.close()


def scenario_exec_parent_closes(port, tmp):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"send 3000000\n")
    out = os.path.join(tmp, "cat-out")
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            os.read(go_r, 1)  # the parent has closed its number
            os.dup2(s.fileno(), 0)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.execvp("cat", ["cat"])
        finally:
            os._exit(127)
    os.close(go_r)
    s.close()
    os.write(go_w, b"x")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    got = open(out, "rb").read() if os.path.exists(out) else b""
    head, _, body = got.partition(b"\n")
    check(status == 0 and len(body) == 3_000_000 and sha(body) == head.decode(),
          f"10: the parent closed right after the fork; the child's exec'd cat read the 3 MB answer to the end ({len(body)} bytes, status {status})")
    end = last_end(port)
    check(end == "end of stream", f"10: cat's exit ended the connection: the server read the end of stream ({end})")


def scenario_child_after_close(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"echo\n")
    data = os.urandom(2_000_000)
    go_r, go_w = os.pipe()

    def child():
        os.close(go_w)
        os.read(go_r, 1)  # the parent has closed its number
        s.sendall(b"ping")
        first = read_exact(s, 4)
        import threading
        t = threading.Thread(target=lambda: s.sendall(data))
        t.start()
        got = read_exact(s, len(data))
        t.join()
        s.close()  # no shutdown: the close alone ends the connection
        return "%s %s" % (first.decode(), "same" if got == data else "differs")
    pid, r = in_child(child)
    os.close(go_r)
    s.close()
    os.write(go_w, b"x")
    os.close(go_w)
    res, status = child_result(pid, r)
    check(res == "ping same" and status == 0,
          f"11: the parent closed right after the fork; the child's 2 MB echo ({res})")
    end = last_end(port)
    check(end == "end of stream", f"11: the child's close ended the connection: the server read the end of stream ({end})")


def client(port, smc):
    scenario_rsync(port, smc)
    scenario_reverse(port)
    scenario_handoff(port)
    scenario_epoll(port)
    scenario_parent_closes(port)
    scenario_owner_exits(port)
    scenario_poll_asleep(port)
    scenario_reset(port)
    tmp = tempfile.mkdtemp()
    scenario_exec(port, tmp)
    scenario_exec_parent_closes(port, tmp)
    scenario_child_after_close(port)
    q = socket.create_connection(("127.0.0.1", port))
    q.sendall(b"quit\n")
    q.close()


def main():
    role, port, smc = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if role == "server":
        server(port)
    else:
        client(port, smc)
    if FAILED:
        print("%d FAILED" % len(FAILED), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
