"""A python asyncio streams echo server and client for scripts/preload-apps.sh.

  python3 preload-asyncio.py server PORT CONNS        echo CONNS connections, then exit
  python3 preload-asyncio.py client PORT CONNS BYTES  CONNS concurrent connections, BYTES each way

Each client connection writes BYTES of random data in 100 kB pieces from one task (drain
after each, then write_eof) while another reads the echo to the end of stream; the SHA-256
of what came back must be the one of what was sent. Exit 1 on a mismatch, an error or after
60 s.
"""

import asyncio
import hashlib
import os
import sys


async def server(port, conns):
    left = [conns, 0]
    done = asyncio.Event()

    async def handle(r, w):
        while True:
            b = await r.read(65536)
            if not b:
                break
            left[1] += len(b)
            w.write(b)
            await w.drain()
        w.write_eof()
        await w.drain()
        w.close()
        await w.wait_closed()
        left[0] -= 1
        if left[0] == 0:
            done.set()

    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    async with srv:
        await done.wait()
    print(f"asyncio server: {conns} connections, {left[1]} bytes echoed")


async def one(port, i, n):
    data = os.urandom(n)
    r, w = await asyncio.open_connection("127.0.0.1", port)

    async def send():
        for k in range(0, n, 100_000):
            w.write(data[k : k + 100_000])
            await w.drain()
        w.write_eof()

    t = asyncio.create_task(send())
    h, got = hashlib.sha256(), 0
    while True:
        b = await r.read(65536)
        if not b:
            break
        h.update(b)
        got += len(b)
    await t
    w.close()
    if got != n or h.digest() != hashlib.sha256(data).digest():
        raise RuntimeError(f"connection {i}: {got} of {n} bytes back, or a different SHA-256")


async def client(port, conns, n):
    await asyncio.gather(*[one(port, i, n) for i in range(conns)])
    print(f"asyncio client: {conns} connections, {n} bytes each, echoes right")


def main():
    mode, port, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    work = server(port, conns) if mode == "server" else client(port, conns, int(sys.argv[4]))
    try:
        asyncio.run(asyncio.wait_for(work, 60))
    except Exception as e:  # noqa: BLE001 - any failure is the check's failure
        print(f"preload-asyncio: {e!r}")
        sys.exit(1)


main()
