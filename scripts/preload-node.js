// A node (libuv) echo server and client for scripts/preload-apps.sh, `net` module only.
//   node preload-node.js server PORT CONNS        echo CONNS connections (half-close kept), then exit
//   node preload-node.js client PORT CONNS BYTES  CONNS concurrent connections, BYTES each way
// The client writes BYTES of random data and ends its side at once (`end(data)`), reads the
// echo to the end of stream and compares the SHA-256; exit 1 on any mismatch or error.
'use strict';
const net = require('net'), crypto = require('crypto');
const [mode, port, conns, bytes] = [process.argv[2], +process.argv[3], +process.argv[4], +process.argv[5]];
const fail = (what) => { console.log('preload-node:', what); process.exit(1); };
setTimeout(() => fail('not done after 60 s'), 60000).unref();
if (mode === 'server') {
  let served = 0, echoed = 0;
  const srv = net.createServer({ allowHalfOpen: true }, (s) => {
    s.on('data', (d) => {
      echoed += d.length;
      if (!s.write(d)) { s.pause(); s.once('drain', () => s.resume()); }
    });
    s.on('end', () => s.end());
    s.on('close', () => {
      if (++served === conns) {
        console.log(`node server: ${served} connections, ${echoed} bytes echoed`);
        srv.close();
      }
    });
    s.on('error', (e) => fail(`server: ${e}`));
  });
  srv.listen(port, '127.0.0.1');
} else {
  let done = 0;
  for (let i = 0; i < conns; i++) {
    const data = crypto.randomBytes(bytes);
    const want = crypto.createHash('sha256').update(data).digest('hex');
    const h = crypto.createHash('sha256');
    let n = 0;
    const c = net.connect({ port, host: '127.0.0.1', allowHalfOpen: true }, () => c.end(data));
    c.on('data', (d) => { h.update(d); n += d.length; });
    c.on('end', () => {
      if (n !== bytes || h.digest('hex') !== want) fail(`connection ${i}: ${n} of ${bytes} bytes back, or a different SHA-256`);
      if (++done === conns) { console.log(`node client: ${conns} connections, ${bytes} bytes each, echoes right`); process.exit(0); }
    });
    c.on('error', (e) => fail(`client: ${e}`));
  }
}
