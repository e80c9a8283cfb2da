// Send N events with the npm `lumberjack-protocol` client (Lumberjack v1 over TLS).
// usage: node lj_v1_send.js HOST PORT CA_PEM COUNT [WINDOW] [CLIENT_CERT CLIENT_KEY]
// Prints one JSON line {"sent": N, "lastAck": seq} once the server acked the last sequence
// number (the client numbers frames 1..N on one connection); exits 1 on error or timeout.
'use strict';
const fs = require('fs');
const path = require('path');
const lumberjack = require(path.join(__dirname, 'node_modules', 'lumberjack-protocol'));

const [host, port, caPath, countArg, windowArg, certPath, keyPath] = process.argv.slice(2);
const count = parseInt(countArg, 10);
const windowSize = parseInt(windowArg || '1000', 10);
const tlsOptions = { host, port: parseInt(port, 10), ca: [fs.readFileSync(caPath)] };
if (certPath) {
  tlsOptions.cert = fs.readFileSync(certPath);
  tlsOptions.key = fs.readFileSync(keyPath);
}
// allowDrop: never drop (the client otherwise drops past 10 windows unacknowledged).
const client = lumberjack.client(tlsOptions, {
  windowSize,
  maxQueueSize: count + 1,
  allowDrop: () => false,
  reconnect: 200,
});
let dropped = 0;
client.on('dropped', (n) => { dropped += n; });
client.on('disconnect', (err) => { if (err) console.error('disconnect:', err.message); });

let written = false;
client.on('connect', () => {
  if (written) return;
  written = true;
  for (let i = 0; i < count; i++) {
    client.writeDataFrame({ line: `node event ${i} \u00e9\u6f22`, n: String(i), type: 'nodetest', host: 'node-peer' });
  }
});

const timer = setTimeout(() => {
  const ack = client._socket ? client._socket.lastAck : -1;
  console.error(`timeout: lastAck ${ack} of ${count}, dropped ${dropped}`);
  process.exit(1);
}, 60000);

const poll = setInterval(() => {
  const sock = client._socket;
  if (sock && sock.lastAck >= count) {
    clearInterval(poll);
    clearTimeout(timer);
    console.log(JSON.stringify({ sent: count, lastAck: sock.lastAck, dropped }));
    client.close();
    process.exit(dropped ? 1 : 0);
  }
}, 20);
