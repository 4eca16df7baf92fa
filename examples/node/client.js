// A demonet coordinator-mode client written from docs/protocol.md: it probes the run, joins with its own Ed25519
// key, sends signed heartbeats, downloads the parameters and checks their digest, decodes the aggregate of the
// round before it joined, and leaves. It trains nothing. Prints one JSON line of what it saw.
//
//   node client.js --address HOST:PORT --token TOKEN [--peer-id node-1] [--proto ../../proto/demonet.proto]
//                  [--wait-s 90] [--save-aggregate FILE]
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { PROTOCOL, statements, reassemble, paramDigest, decodePayload, payloadSummary, loadTypes } =
  require('./protocol');

const CALL_S = 10; // a unary call's deadline
const { values: args } = parseArgs({ options: {
  address: { type: 'string' }, token: { type: 'string', default: '' }, 'peer-id': { type: 'string', default: 'node-1' },
  proto: { type: 'string', default: path.resolve(__dirname, '..', '..', 'proto', 'demonet.proto') },
  'wait-s': { type: 'string', default: '90' }, // GetParameters and GetAggregate: 2 x round_timeout_s + 30 s or more
  'save-aggregate': { type: 'string' }, // write the aggregate's serialized Payload here (a test decodes it too)
} });

function connect(protoPath, address) {
  const def = protoLoader.loadSync(protoPath, { keepCase: true, longs: String, enums: String, bytes: Buffer,
    defaults: true, oneofs: true });
  const { Coordinator } = grpc.loadPackageDefinition(def).demonet.v1;
  return new Coordinator(address, grpc.credentials.createInsecure());
}

function deadline(seconds) { return new Date(Date.now() + 1000 * seconds); }

function unary(client, method, request, metadata) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline(CALL_S) }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

function stream(client, method, request, metadata, waitS) {
  return new Promise((resolve, reject) => {
    const messages = [];
    const call = client[method](request, metadata, { deadline: deadline(waitS) });
    call.on('data', (m) => messages.push(m));
    call.on('error', reject);
    call.on('end', () => resolve(messages));
  });
}

// Our own key: its 32 raw public bytes (the JWK's x) and a signer.
function newKey() {
  const { publicKey, privateKey } = crypto.generateKeyPairSync('ed25519');
  return { public: Buffer.from(publicKey.export({ format: 'jwk' }).x, 'base64url'),
    sign: (bytes) => crypto.sign(null, bytes, privateKey) };
}

async function join(client, md, peerId, key) {
  const probe = await unary(client, 'Join', { peer_id: peerId, probe: true, protocol: PROTOCOL }, md);
  if (probe.protocol !== PROTOCOL) {
    throw new Error(`the coordinator speaks protocol ${probe.protocol || 1}, this client ${PROTOCOL}`);
  }
  const { nonce } = await unary(client, 'Challenge', { peer_id: peerId, public_key: key.public }, md);
  const reply = await unary(client, 'Join', { peer_id: peerId, public_key: key.public, nonce, protocol: PROTOCOL,
    signature: key.sign(statements.join(nonce, peerId, key.public)) }, md);
  return { ...reply, round: BigInt(reply.round), specs: JSON.parse(probe.param_specs) };
}

// The counter of the counted requests (Heartbeat, Leave, GetParameters, a member's GetAggregate): from 1 after
// each join, a new number for every request, retries included (docs/protocol.md, Signed statements).
let counter = 0n;
const nextCounter = () => ++counter;

// Heartbeats every heartbeat_interval_s until stopped; each reply must say we are a member.
function heartbeats(client, md, peerId, key, session, round, intervalS) {
  const seen = { sent: 0, member: true };
  const beat = async () => {
    const n = nextCounter();
    const reply = await unary(client, 'Heartbeat', { peer_id: peerId, round: String(round), counter: String(n),
      signature: key.sign(statements.heartbeat(session, peerId, round, n)) }, md);
    seen.sent++;
    seen.member = seen.member && reply.member;
  };
  const timer = setInterval(() => beat().catch(() => { seen.member = false; }), 1000 * intervalS);
  return { seen, beat, stop: () => clearInterval(timer) };
}

async function parameters(client, md, peerId, key, session, round, specs, types, waitS) {
  const n = nextCounter();
  const request = { peer_id: peerId, round: String(round), resync: false, counter: String(n),
    signature: key.sign(statements.parameters(session, peerId, round, false, n)) };
  const data = reassemble(await stream(client, 'GetParameters', request, md, waitS));
  const msg = types.Parameters.toObject(types.Parameters.decode(data), { longs: String, defaults: true });
  if (msg.version !== PROTOCOL) throw new Error(`parameters of protocol ${msg.version}, this client ${PROTOCOL}`);
  const tensors = msg.tensors.map((t) => ({ name: t.name, dtype: t.dtype, shape: t.shape.map(Number),
    data: Buffer.from(t.data) }));
  const names = JSON.stringify(tensors.map((t) => [t.name, t.shape, t.dtype]));
  if (names !== JSON.stringify(specs)) throw new Error('the parameters do not match param_specs');
  const computed = paramDigest(tensors);
  return { round: Number(msg.round), tensors: tensors.length, digest: msg.param_digest, computed,
    digest_ok: computed === msg.param_digest };
}

async function aggregate(client, md, peerId, key, session, round, types, waitS) {
  const n = nextCounter();  // a member's signed call (unsigned, it would take the shared public path)
  const chunks = await stream(client, 'GetAggregate', { peer_id: peerId, round: String(round), submitting: false,
    counter: String(n), signature: key.sign(statements.aggregate(session, peerId, round, false, n)) }, md, waitS);
  const header = chunks[0].header;
  const trailer = chunks[chunks.length - 1].trailer;
  if (!header || !trailer) throw new Error('GetAggregate: a stream without its header or trailer');
  const out = { round: Number(header.round), aborted: header.aborted, contributors: header.contributors,
    trailer_digest: trailer.param_digest };
  if (header.aborted) return out;
  const data = reassemble(chunks.slice(1, -1).map((c) => c.part));
  if (args['save-aggregate']) fs.writeFileSync(args['save-aggregate'], data);
  const decoded = decodePayload(data, types.Payload);
  return { ...out, step: decoded.step, encoding: decoded.encoding, tensors: decoded.tensors.length,
    entries: decoded.tensors.reduce((a, t) => a + t.values.length, 0),
    index_codings: [...new Set(decoded.tensors.map((t) => t.indexCoding))].sort(),
    value_codings: [...new Set(decoded.tensors.map((t) => t.valueCoding))].sort(),
    summary_sha256: payloadSummary(decoded) };
}

async function main() {
  const peerId = args['peer-id'];
  const waitS = Number(args['wait-s']);
  const client = connect(args.proto, args.address);
  const types = loadTypes(args.proto);
  const md = new grpc.Metadata();
  if (args.token) md.set('authorization', `Bearer ${args.token}`);
  const key = newKey();
  const joined = await join(client, md, peerId, key);
  if (joined.round === 0n) throw new Error('joined at round 0: there is no closed round to read yet');
  const beats = heartbeats(client, md, peerId, key, joined.session, joined.round, joined.heartbeat_interval_s);
  try {
    await beats.beat();
    const params = await parameters(client, md, peerId, key, joined.session, joined.round, joined.specs, types, waitS);
    const agg = await aggregate(client, md, peerId, key, joined.session, joined.round - 1n, types, waitS);
    await beats.beat();
    beats.stop();
    const n = nextCounter();
    const left = await unary(client, 'Leave', { peer_id: peerId, round: String(joined.round), counter: String(n),
      signature: key.sign(statements.leave(joined.session, peerId, joined.round, n)) }, md);
    console.log(JSON.stringify({ protocol: PROTOCOL, peer_id: peerId, public_key: key.public.toString('hex'),
      joined_round: Number(joined.round), heartbeats: beats.seen.sent, member: beats.seen.member,
      parameters: params, aggregate: agg,
      trailer_is_parameters_digest: params.round === agg.round + 1 ? agg.trailer_digest === params.digest : null,
      left: left.left }));
  } finally {
    beats.stop();
    client.close();
  }
}

main().catch((e) => {
  console.error(`node client: ${e.message || e}`);
  process.exit(1);
});
