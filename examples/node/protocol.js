// The byte-level rules of docs/protocol.md: signed statements, parts, the parameter digest, payloads.
// Written from the page alone; nothing here knows demonet's Python code.
'use strict';

const crypto = require('node:crypto');
const zlib = require('node:zlib');
const protobuf = require('protobufjs');

const DOMAIN = Buffer.from('demonet/v1\0', 'latin1');
const PROTOCOL = 3;

// -- signed statements (docs/protocol.md, Signed statements) ------------------------------------------

function u32(n) {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n);
  return b;
}

function u64(n) {
  const b = Buffer.alloc(8);
  b.writeBigUInt64LE(BigInt(n));
  return b;
}

// fields: [tag, value] pairs; tags y (bytes), s (UTF-8 string), i (u64), f (f64), b (bool).
function statement(kind, fields) {
  const out = [DOMAIN, Buffer.from(kind, 'ascii'), Buffer.from([0])];
  for (const [tag, value] of fields) {
    let data;
    if (tag === 'y') data = Buffer.from(value);
    else if (tag === 's') data = Buffer.from(value, 'utf8');
    else if (tag === 'i') data = u64(value);
    else if (tag === 'f') { data = Buffer.alloc(8); data.writeDoubleLE(value); }
    else if (tag === 'b') data = Buffer.from([value ? 1 : 0]);
    else throw new Error(`unknown field tag ${tag}`);
    out.push(Buffer.from(tag, 'ascii'), u32(data.length), data);
  }
  return Buffer.concat(out);
}

const statements = {
  join: (nonce, peerId, publicKey) => statement('join', [['y', nonce], ['s', peerId], ['y', publicKey]]),
  heartbeat: (session, peerId, round, counter) =>
    statement('heartbeat', [['y', session], ['s', peerId], ['i', round], ['i', counter]]),
  leave: (session, peerId, round, counter) =>
    statement('leave', [['y', session], ['s', peerId], ['i', round], ['i', counter]]),
  parameters: (session, peerId, round, resync, counter) =>
    statement('parameters', [['y', session], ['s', peerId], ['i', round], ['b', resync], ['i', counter]]),
  aggregate: (session, peerId, round, submitting, counter) =>
    statement('aggregate', [['y', session], ['s', peerId], ['i', round], ['b', submitting], ['i', counter]]),
  taskFiles: (session, peerId, counter) =>
    statement('task-files', [['y', session], ['s', peerId], ['i', counter]]),
};

// -- parts (docs/protocol.md, Parts) ------------------------------------------------------------------

function reassemble(parts) {
  if (parts.length === 0) throw new Error('no parts');
  const first = parts[0];
  const count = Number(first.count);
  const total = Number(first.total_bytes);
  const byIndex = new Map();
  for (const p of parts) {
    if (!p.payload_digest.equals(first.payload_digest) || Number(p.count) !== count
        || Number(p.total_bytes) !== total) throw new Error('parts disagree on digest, count or size');
    if (byIndex.has(p.index) || p.data.length === 0) throw new Error(`part ${p.index} twice or empty`);
    byIndex.set(p.index, p.data);
  }
  if (byIndex.size !== count) throw new Error(`${byIndex.size} of ${count} parts`);
  const whole = Buffer.concat([...Array(count).keys()].map((i) => byIndex.get(i)));
  if (whole.length !== total) throw new Error(`${whole.length} bytes, announced ${total}`);
  if (!crypto.createHash('sha256').update(whole).digest().equals(first.payload_digest)) {
    throw new Error('the parts do not hash to their payload_digest');
  }
  return whole;
}

// -- the parameter digest (docs/protocol.md, The parameter digest) ------------------------------------

// tensors: [{name, dtype, shape: [numbers], data: Buffer}] in the model's order.
function paramDigest(tensors) {
  const h = crypto.createHash('sha256');
  for (const t of tensors) {
    const name = Buffer.from(t.name, 'utf8');
    const dtype = Buffer.from(t.dtype, 'ascii');
    h.update(Buffer.concat([u32(name.length), name, u32(dtype.length), dtype, u32(t.shape.length),
      ...t.shape.map(u64), u64(t.data.length)]));
    h.update(t.data);
  }
  return h.digest('hex').slice(0, 32);
}

// -- payloads (docs/protocol.md, Payloads) ------------------------------------------------------------

class BitReader {
  constructor(buf) { this.buf = buf; this.pos = 0; }

  bit() {
    const j = this.pos++;
    if (j >= 8 * this.buf.length) throw new Error('bit stream too short');
    return (this.buf[j >> 3] >> (j & 7)) & 1;
  }

  field(width) { // least significant bit first
    let v = 0;
    for (let i = 0; i < width; i++) v += this.bit() * 2 ** i;
    return v;
  }
}

function bitLength(x) { return x === 0 ? 0 : Math.floor(Math.log2(x)) + 1; }

function matrix(shape) {
  if (shape.length === 0) return [1, 1];
  if (shape.length === 1) return [1, shape[0]];
  return [shape[0], shape.slice(1).reduce((a, b) => a * b, 1)];
}

// Indices of every chunk, as the tensor's index coding stores them: [[i, ...] per chunk].
function decodeIndices(coding, bytes, numChunks, n, k) {
  const r = new BitReader(bytes);
  const chunks = [];
  for (let c = 0; c < numChunks; c++) {
    const idx = [];
    if (coding === 'INDEX_CODING_PACKED') {
      for (let i = 0; i < k; i++) idx.push(r.field(bitLength(n - 1)));
    } else if (coding === 'INDEX_CODING_ELIAS_FANO') {
      const l = k > 0 ? bitLength(Math.floor(n / k)) - 1 : 0;
      const low = [];
      for (let i = 0; i < k; i++) low.push(r.field(l));
      const upper = k > 0 ? k + ((n - 1) >> l) : 0;
      for (let p = 0; p < upper; p++) {
        if (r.bit()) { idx.push((p - idx.length) * 2 ** l + low[idx.length]); }
      }
      if (idx.length !== k) throw new Error(`Elias-Fano chunk ${c}: ${idx.length} set bits, expected ${k}`);
    } else if (coding === 'INDEX_CODING_BITMAP') {
      for (let i = 0; i < n; i++) if (r.bit()) idx.push(i);
      if (idx.length !== k) throw new Error(`bitmap chunk ${c}: ${idx.length} set bits, expected ${k}`);
    } else {
      throw new Error(`unknown index coding ${coding}`);
    }
    chunks.push(idx);
  }
  if (r.pos < 8 * bytes.length - 7 || (r.pos % 8 && bytes[bytes.length - 1] >> (r.pos % 8))) {
    throw new Error('index bytes: trailing bytes or padding bits that are not 0');
  }
  return chunks;
}

function f16(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

function bf16(buf, i) { // the high 16 bits of a float32
  const b = Buffer.alloc(4);
  b.writeUInt16LE(buf.readUInt16LE(2 * i), 2);
  return b.readFloatLE(0);
}

const WIDTH = { VALUE_ENCODING_FP32: 4, VALUE_ENCODING_BF16: 2, VALUE_ENCODING_FP16: 2, VALUE_ENCODING_INT8: 1 };

// The value bytes as PLAIN would store them (TOP_PLANE_DEFLATE: planes 0..w-2 raw, then plane w-1 deflated).
function plainValues(t, count) {
  if (t.value_coding !== 'VALUE_CODING_TOP_PLANE_DEFLATE') return t.values;
  const w = WIDTH[t.value_encoding];
  const raw = t.values.subarray(0, (w - 1) * count);
  const top = zlib.inflateRawSync(t.values.subarray((w - 1) * count), { maxOutputLength: count + 1 });
  if (top.length !== count || raw.length !== (w - 1) * count) throw new Error('deflated values: wrong size');
  const out = Buffer.alloc(w * count);
  for (let i = 0; i < count; i++) {
    for (let j = 0; j < w - 1; j++) out[w * i + j] = raw[j * count + i];
    out[w * i + w - 1] = top[i];
  }
  return out;
}

function decodeValues(t, numChunks, k) {
  const count = numChunks * k;
  const v = plainValues(t, count);
  const s = t.scales;
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    const c = Math.floor(i / k);
    switch (t.value_encoding) {
      case 'VALUE_ENCODING_FP32': out[i] = v.readFloatLE(4 * i); break;
      case 'VALUE_ENCODING_BF16': out[i] = bf16(v, i); break;
      case 'VALUE_ENCODING_FP16': out[i] = f16(v.readUInt16LE(2 * i)) * s.readFloatLE(0); break;
      case 'VALUE_ENCODING_INT8': { const q = v.readInt8(i); out[i] = q === -128 ? -0 : q * bf16(s, c); break; }
      case 'VALUE_ENCODING_SIGN': out[i] = ((v[i >> 3] >> (i & 7)) & 1 ? -1 : 1) * bf16(s, c); break;
      default: throw new Error(`unknown value encoding ${t.value_encoding}`);
    }
    if (!Number.isFinite(out[i])) throw new Error(`${t.name}: a value that is not finite`);
  }
  return out;
}

// A serialized Payload -> {step, tensors: [{name, shape, k, n, indexCoding, valueCoding, indices, values}]}.
function decodePayload(data, PayloadType) {
  const head = data.subarray(data.length - 34, data.length - 32);
  const digest = crypto.createHash('sha256').update(data.subarray(0, data.length - 34)).digest();
  if (data.length < 34 || head[0] !== 0x7a || head[1] !== 0x20 || !digest.equals(data.subarray(data.length - 32))) {
    throw new Error('the payload does not end with its SHA-256 digest');
  }
  const msg = PayloadType.toObject(PayloadType.decode(data), { enums: String, longs: Number, defaults: true });
  for (const t of msg.tensors) for (const f of ['indices', 'values', 'scales']) t[f] = Buffer.from(t[f]);
  if (msg.version !== 1) throw new Error(`payload version ${msg.version}, this client reads 1`);
  const tensors = msg.tensors.map((t) => {
    const shape = t.shape.map(Number);
    const [rows, cols] = matrix(shape);
    const numChunks = Math.ceil(rows / t.chunk_h) * Math.ceil(cols / t.chunk_w);
    const n = t.chunk_h * t.chunk_w;
    if (t.k > n) throw new Error(`${t.name}: k ${t.k} > n ${n}`);
    const indices = decodeIndices(t.index_coding, t.indices, numChunks, n, t.k);
    return { name: t.name, shape, n, k: t.k, indexCoding: t.index_coding, valueCoding: t.value_coding,
      indices, values: decodeValues(t, numChunks, t.k) };
  });
  return { step: msg.step, encoding: msg.encoding, tensors };
}

// SHA-256 over every tensor's indices (u32) and values (float32), chunk by chunk: what a test compares.
function payloadSummary(decoded) {
  const h = crypto.createHash('sha256');
  for (const t of decoded.tensors) {
    const flat = t.indices.flat();
    const idx = Buffer.alloc(4 * flat.length);
    flat.forEach((x, i) => idx.writeUInt32LE(x, 4 * i));
    h.update(idx);
    h.update(Buffer.from(t.values.buffer, t.values.byteOffset, t.values.byteLength));
  }
  return h.digest('hex');
}

// The Payload and Parameters message types of proto/demonet.proto, with the field names as the file spells them.
function loadTypes(protoPath) {
  const root = new protobuf.Root().loadSync(protoPath, { keepCase: true });
  return { Payload: root.lookupType('demonet.v1.Payload'), Parameters: root.lookupType('demonet.v1.Parameters') };
}

module.exports = { PROTOCOL, loadTypes, statement, statements, reassemble, paramDigest, decodePayload, payloadSummary };
