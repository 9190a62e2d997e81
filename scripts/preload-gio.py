"""A GLib/GIO echo server and client (GMainLoop: poll-based) for scripts/preload-apps.sh.

  python3 preload-gio.py server PORT CONNS        echo CONNS connections, then exit
  python3 preload-gio.py client PORT CONNS BYTES  CONNS concurrent connections, BYTES each way

Gio.SocketService accepts from the main loop; every read and write is an asynchronous GIO
call (read_bytes_async, write_all_async: a nonblocking attempt, then a GSource on the socket
until it is ready). Each client writes BYTES of random data with one write_all_async, then
shuts down its writing side, and reads the echo to the end of stream; its SHA-256 must be
the one of what was sent. Exit 1 on a mismatch, an error or after 60 s. (Runs with the
system's python3, which has the gi module: Debian's python3-gi.)
"""

import hashlib
import os
import sys

import gi

gi.require_version("Gio", "2.0")
from gi.repository import Gio, GLib  # noqa: E402

PRIO = GLib.PRIORITY_DEFAULT


def main():
    mode, port, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    loop = GLib.MainLoop()
    st = {"left": conns, "bytes": 0, "bad": 0, "error": None}

    def timeout():
        st["error"] = "timeout"
        loop.quit()

    GLib.timeout_add_seconds(60, timeout)

    def done_one():
        st["left"] -= 1
        if st["left"] == 0:
            loop.quit()

    def failed(e):
        st["error"] = repr(e)
        loop.quit()

    keep = []
    if mode == "server":

        def serve(conn):
            i, o = conn.get_input_stream(), conn.get_output_stream()
            # The buffer of an asynchronous write must outlive it: Python would free a
            # temporary while GIO still writes from it.
            pending = []

            def on_read(_src, res):
                try:
                    b = i.read_bytes_finish(res)
                    if b.get_size() == 0:
                        conn.get_socket().shutdown(False, True)
                        conn.close(None)
                        done_one()
                        return
                    st["bytes"] += b.get_size()
                    pending[:] = [b.get_data()]
                    o.write_all_async(pending[0], PRIO, None, on_written)
                except GLib.Error as e:
                    failed(e)

            def on_written(_src, res):
                try:
                    o.write_all_finish(res)
                    i.read_bytes_async(65536, PRIO, None, on_read)
                except GLib.Error as e:
                    failed(e)

            i.read_bytes_async(65536, PRIO, None, on_read)

        def incoming(_svc, conn, _src):
            keep.append(conn)
            serve(conn)
            return False

        svc = Gio.SocketService()
        addr = Gio.InetSocketAddress.new_from_string("127.0.0.1", port)
        svc.add_address(addr, Gio.SocketType.STREAM, Gio.SocketProtocol.TCP, None)
        svc.connect("incoming", incoming)
        svc.start()
        loop.run()
        if st["error"]:
            print(f"preload-gio server: {st['error']}")
            sys.exit(1)
        print(f"gio server: {conns} connections, {st['bytes']} bytes echoed")
        return

    n = int(sys.argv[4])
    data = os.urandom(n)
    want = hashlib.sha256(data).digest()
    client = Gio.SocketClient()

    def on_conn(_src, res):
        try:
            conn = client.connect_finish(res)
        except GLib.Error as e:
            failed(e)
            return
        keep.append(conn)
        i, o = conn.get_input_stream(), conn.get_output_stream()
        h, got = hashlib.sha256(), [0]

        def wrote(_s, r):
            try:
                o.write_all_finish(r)
                conn.get_socket().shutdown(False, True)
            except GLib.Error as e:
                failed(e)

        def on_read(_s, r):
            try:
                b = i.read_bytes_finish(r)
            except GLib.Error as e:
                failed(e)
                return
            if b.get_size() == 0:
                if got[0] != n or h.digest() != want:
                    print(f"echo differs: {got[0]} of {n} bytes, or a different SHA-256")
                    st["bad"] += 1
                conn.close(None)
                done_one()
                return
            h.update(b.get_data())
            got[0] += b.get_size()
            i.read_bytes_async(65536, PRIO, None, on_read)

        o.write_all_async(data, PRIO, None, wrote)
        i.read_bytes_async(65536, PRIO, None, on_read)

    for _ in range(conns):
        client.connect_to_host_async(f"127.0.0.1:{port}", port, None, on_conn)
    loop.run()
    if st["error"] or st["bad"]:
        print(f"preload-gio client: {st['error'] or str(st['bad']) + ' echoes wrong'}")
        sys.exit(1)
    print(f"gio client: {conns} connections, {n} bytes each, echoes right")


main()
