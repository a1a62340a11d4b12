// One real Node client run: argv[2] is a JSON plan {port, proto: "h2"|"h1", parallel, ops}.
// Each op: {sni, authority, method, path, file, headers, trailers, chunked,
// cancel ('first': at the first answer bytes; 'upload': half-way through the body), announce,
// recover, local (source address)}; plan.deadline (ms) bounds the whole run. Prints
// "FIRST i" on an op's first response bytes (when `announce`) and a last line
// "RESULT <json>" with, per op: status, bytes, sha256, error, and the retry's answer
// when the edge said 421 and `recover` asked the client to go to the right host.
const http2 = require('http2'), https = require('https'), tls = require('tls');
const fs = require('fs'), crypto = require('crypto');
const plan = JSON.parse(process.argv[2]);
const sessions = {};
const agents = {};

function session(sni, local) {
  const key = `${sni} ${local || ''}`;  // one connection per name and source address
  if (!sessions[key] || sessions[key].closed || sessions[key].destroyed) {
    sessions[key] = http2.connect(`https://${sni}:${plan.port}`, {
      createConnection: () => tls.connect({host: '127.0.0.1', port: plan.port, servername: sni,
                                           localAddress: local, ALPNProtocols: ['h2'],
                                           rejectUnauthorized: false})});
    sessions[key].on('error', () => {});
  }
  return sessions[key];
}

function body(op) {
  return op.file ? fs.readFileSync(op.file) : null;
}

function one(op, i) {
  return new Promise((resolve) => {
    const hash = crypto.createHash('sha256');
    const out = {i, status: null, bytes: 0, sha256: null, error: null, headers: null};
    let first = true, done = false;
    const small = [];
    const onData = (c, cancel) => {
      out.bytes += c.length; hash.update(c);
      if (out.bytes <= 4096) small.push(c);
      if (first) {
        first = false;
        if (op.announce) process.stdout.write(`FIRST ${i}\n`);
        if (op.cancel === 'first') cancel();
      }
    };
    const finish = () => {
      if (done) return;
      done = true;
      out.sha256 = hash.digest('hex');
      if (out.bytes <= 4096) out.text = Buffer.concat(small).toString('latin1');
      resolve(out);
    };
    const data = body(op);
    if (plan.proto === 'h2') {
      const s = session(op.sni, op.local);
      const hdrs = Object.assign({':method': op.method || 'GET', ':path': op.path,
                                  ':authority': op.authority || op.sni}, op.headers || {});
      if (data && !op.chunked) hdrs['content-length'] = String(data.length);
      const abort = new AbortController();
      const req = s.request(hdrs, {endStream: !data, waitForTrailers: !!op.trailers,
                                   signal: abort.signal});
      if (op.trailers) req.on('wantTrailers', () => req.sendTrailers(op.trailers));
      req.on('response', (h) => { out.status = h[':status']; out.headers = h; });
      req.on('data', (c) => onData(c, () => req.close(http2.constants.NGHTTP2_CANCEL)));
      req.on('error', (e) => { out.error = String(e.code || e); });
      req.on('close', () => { out.rst = req.rstCode; finish(); });
      if (data && op.cancel === 'upload') {  // half the body, then the stream cancelled
        req.write(data.subarray(0, data.length >> 1));
        // RST_STREAM(CANCEL) alone: `req.close(CANCEL)` ends the body first (an empty
        // DATA with END_STREAM, then the reset), which makes the half body a whole one
        setTimeout(() => abort.abort(), 300);
      } else if (data) req.end(data);
    } else {
      const hdrs = Object.assign({Host: op.authority || op.sni}, op.headers || {});
      if (data && !op.chunked) hdrs['Content-Length'] = String(data.length);
      agents[op.sni] = agents[op.sni] || new https.Agent({keepAlive: true});
      const req = https.request({host: '127.0.0.1', port: plan.port, servername: op.sni,
                                 rejectUnauthorized: false, method: op.method || 'GET',
                                 path: op.path, headers: hdrs, agent: agents[op.sni]});
      req.on('response', (res) => {
        out.status = res.statusCode; out.headers = res.headers;
        res.on('data', (c) => onData(c, () => req.destroy()));
        res.on('end', finish);
        res.on('error', (e) => { out.error = String(e.code || e); });
        res.on('close', () => { if (!res.complete && !out.error) out.error = 'aborted'; finish(); });
      });
      req.on('error', (e) => { out.error = String(e.code || e); finish(); });
      if (data && op.cancel === 'upload') {  // half the body, then the connection gone
        req.write(data.subarray(0, data.length >> 1));
        setTimeout(() => req.destroy(), 300);
        return;
      }
      if (data) {
        if (op.chunked) {  // several writes, no length: chunked transfer coding
          for (let o = 0; o < data.length; o += 100000) req.write(data.subarray(o, o + 100000));
        } else req.write(data);
      }
      if (op.trailers) req.addTrailers(op.trailers);
      req.end();
    }
  });
}

async function run(op, i) {
  const res = await one(op, i);
  if (op.recover && res.status === 421) {  // what a coalescing client does on 421
    res.retry = await one(Object.assign({}, op, {sni: op.authority}), i);
  }
  return res;
}

(async () => {
  let results = [];
  if (plan.parallel) results = await Promise.all(plan.ops.map(run));
  else for (const [i, op] of plan.ops.entries()) results.push(await run(op, i));
  process.stdout.write('RESULT ' + JSON.stringify(results) + '\n');
  for (const s of Object.values(sessions)) s.close();
  for (const a of Object.values(agents)) a.destroy();
})();
setTimeout(() => { process.stdout.write('TIMEOUT\n'); process.exit(3); }, plan.deadline || 30000).unref();
