// Checks protocol.js against demonet's test vectors (tests/vectors/*.json): statements and their signatures,
// the parameter digest, and payload decoding. Prints one JSON line; exits 1 on the first mismatch.
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { statement, paramDigest, decodePayload, payloadSummary, loadTypes } = require('./protocol');

const root = path.resolve(__dirname, '..', '..');
const vectors = (name) => JSON.parse(fs.readFileSync(path.join(root, 'tests', 'vectors', name), 'utf8'));
const TAG = { bytes: 'y', str: 's', int: 'i', float: 'f', bool: 'b' };

function check(what, ok) { if (!ok) { throw new Error(`vector mismatch: ${what}`); } }

// An Ed25519 private key from its 32-byte seed: the seed inside PKCS#8's fixed DER prefix (RFC 8410).
function keyFromSeed(seed) {
  const der = Buffer.concat([Buffer.from('302e020100300506032b657004220420', 'hex'), seed]);
  return crypto.createPrivateKey({ key: der, format: 'der', type: 'pkcs8' });
}

const s = vectors('statements.json');
const key = keyFromSeed(Buffer.from(s.test_key.seed_hex, 'hex'));
let statements = 0;
for (const v of s.vectors) {
  const fields = v.inputs.map((i) => {
    const value = i.type === 'bytes' ? Buffer.from(i.value, 'hex') : i.value;
    // DHT messages sign the SHA-256 of their body (docs/protocol.md).
    return i.name === 'body' ? ['y', crypto.createHash('sha256').update(value).digest()] : [TAG[i.type], value];
  });
  const bytes = statement(v.kind, fields);
  check(`${v.kind} statement`, bytes.toString('hex') === v.statement_hex);
  check(`${v.kind} signature`, crypto.sign(null, bytes, key).toString('hex') === v.signature_hex);
  statements++;
}

let digests = 0;
for (const v of vectors('parameters.json').vectors) {
  const tensors = v.tensors.map((t) => ({ ...t, data: Buffer.from(t.data_hex, 'hex') }));
  check(`digest of ${v.about}`, paramDigest(tensors) === v.param_digest);
  digests++;
}

const { Payload } = loadTypes(path.join(root, 'proto', 'demonet.proto'));
let payloads = 0;
for (const v of vectors('payloads.json').vectors) {
  const decoded = decodePayload(Buffer.from(v.payload_hex, 'hex'), Payload);
  const [want] = v.tensors;
  const [got] = decoded.tensors;
  check(`${v.about}: step`, decoded.step === v.step && decoded.encoding === v.encoding);
  check(`${v.about}: codings`, got.indexCoding === want.index_coding && got.valueCoding === want.value_coding);
  check(`${v.about}: indices`, JSON.stringify(got.indices) === JSON.stringify(want.indices));
  const values = want.values.flat();
  check(`${v.about}: values`, values.length === got.values.length
    && values.every((x, i) => Object.is(Math.fround(x), got.values[i])));
  check(`${v.about}: summary`, payloadSummary(decoded).length === 64);
  payloads++;
}
console.log(JSON.stringify({ statements, digests, payloads }));
