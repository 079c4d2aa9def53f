'use strict';
// Node.js client of the loraplane control plane.
//
// The .proto files are the contract: they are loaded at run time with @grpc/proto-loader (no
// generated code), from `protos/` in this package's folder (an installed package: `npm pack`
// copies the repository's protos/ there, package.json "prepack") or, in a checkout, from the
// repository's protos/ (../../protos). Adapter maps follow the same rule as the Python
// client: `adapters` null/undefined leaves GenerateRequest.adapters unset (the control plane's
// default set); an object (even {}) sets an AdapterMap (exactly those adapters, others at 0).

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const fs = require('fs');
const net = require('net');

const PROTO_FILE = 'loraplane/v1/control_plane.proto';
const PROTO_ROOTS = [path.join(__dirname, 'protos'), path.resolve(__dirname, '..', '..', 'protos')];

// The first of PROTO_ROOTS holding PROTO_FILE (the package's own copy first); throws naming
// every place looked at when none does.
function findProtoRoot() {
  const found = PROTO_ROOTS.find((root) => fs.existsSync(path.join(root, PROTO_FILE)));
  if (found === undefined) {
    throw new Error(`${PROTO_FILE} not found in ${PROTO_ROOTS.join(' or ')}: install the package `
      + 'from `npm pack` (which copies the protos in) or run it from a loraplane checkout');
  }
  return found;
}

let cachedPackage = null;

function loadPackage() {
  if (cachedPackage === null) {
    const definition = protoLoader.loadSync(PROTO_FILE, {
      includeDirs: [findProtoRoot()],
      keepCase: true, // field names as in the .proto (token_ids, not tokenIds)
      longs: Number,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    cachedPackage = grpc.loadPackageDefinition(definition).loraplane.v1;
  }
  return cachedPackage;
}

// grpc status number -> name (grpc.status is { OK: 0, CANCELLED: 1, ... }).
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

class LoraplaneError extends Error {
  constructor(code, message) {
    super(`${code}: ${message}`);
    this.code = code; // gRPC status name, e.g. "NOT_FOUND"
    this.details = message;
  }
}

class ServerUnreachable extends LoraplaneError {
  constructor(addr, reason) {
    super('UNAVAILABLE', `cannot reach loraplane server at ${addr}: ${reason}`);
    this.addr = addr;
  }
}

function createClient(addr) {
  const pkg = loadPackage();
  return new pkg.ControlPlane(addr, grpc.credentials.createInsecure());
}

const HTTP2_PREFACE = 'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n'; // RFC 9113 section 3.4
const HTTP_PROBE_TIMEOUT_MS = 1000;
const HOST_PORT = /^(\[[0-9A-Fa-f:.]+\]|[^:/[\]]+):([0-9]{1,5})$/;
const HTTP_NOT_GRPC = 'the address answers HTTP/1.x, not gRPC: it is an HTTP port (the control '
  + "plane's --http-addr, or a metrics port), not the gRPC one; point --addr (or "
  + "$LORAPLANE_ADDR) at the control plane's gRPC address, its own --addr (default port 50051)";

// Resolves true when addr (host:port; other target forms are not probed) answers gRPC's HTTP/2
// preface with an HTTP/1.x status line (the HTTP front, a metrics port); false otherwise, on
// any error. The Python client's clients/channel.py `answers_http1`, same message.
function answersHttp1(addr) {
  const m = HOST_PORT.exec(addr.trim());
  if (m === null) return Promise.resolve(false);
  return new Promise((resolve) => {
    const socket = net.connect({ host: m[1].replace(/^\[|\]$/g, ''), port: Number(m[2]) });
    let answer = Buffer.alloc(0);
    const done = (value) => { socket.destroy(); resolve(value); };
    socket.setTimeout(HTTP_PROBE_TIMEOUT_MS, () => done(false));
    socket.on('error', () => done(false));
    socket.on('connect', () => socket.write(HTTP2_PREFACE));
    socket.on('data', (chunk) => {
      answer = Buffer.concat([answer, chunk]);
      if (answer.length >= 7) done(answer.subarray(0, 7).toString('latin1') === 'HTTP/1.');
    });
    socket.on('end', () => done(answer.toString('latin1').startsWith('HTTP/1.')));
  });
}

// Resolve when the channel is READY; reject with ServerUnreachable on the first connection
// failure (nothing listening, name not resolved, an HTTP/1.x port: HTTP_NOT_GRPC) or after
// timeoutMs (as the Python client).
function waitReady(client, addr, timeoutMs) {
  const channel = client.getChannel();
  const deadline = Date.now() + timeoutMs;
  const { READY, TRANSIENT_FAILURE, SHUTDOWN } = grpc.connectivityState;
  return new Promise((resolve, reject) => {
    const check = () => {
      const state = channel.getConnectivityState(true);
      if (state === READY) return resolve();
      if (state === SHUTDOWN) return reject(new ServerUnreachable(addr, 'the client was closed'));
      if (state === TRANSIENT_FAILURE) {
        answersHttp1(addr).then((http1) => reject(new ServerUnreachable(addr, http1 ? HTTP_NOT_GRPC
          : 'connection failed (is the server running and the address right?)')));
        return undefined;
      }
      channel.watchConnectivityState(state, deadline, (err) => {
        if (err) reject(new ServerUnreachable(addr, `not ready within ${timeoutMs / 1000}s`));
        else check();
      });
      return undefined;
    };
    check();
  });
}

const UINT32_MAX = 2 ** 32 - 1; // adapter ids are uint32 on the wire
const ASCII_DIGITS = /^[0-9]+$/;

// One AdapterScale: the key names the adapter by id when it is a non-negative integer or a
// string of ASCII digits only (the control plane's rule, control_plane/resolution.py
// `is_id_token`: such a token is never a name), by `name` (a name or an alias, resolved by the
// control plane: an unknown one is NOT_FOUND from the server) otherwise. Throws TypeError for
// an empty name or a non-finite scale, RangeError for an id outside 0..UINT32_MAX.
function adapterScale(key, scale) {
  const value = Number(scale);
  if (!Number.isFinite(value)) {
    throw new TypeError(`scale of adapter ${JSON.stringify(key)} must be a finite number, got ${scale}`);
  }
  if (typeof key === 'number' || (typeof key === 'string' && ASCII_DIGITS.test(key))) {
    const id = Number(key);
    if (!Number.isSafeInteger(id) || id < 0 || id > UINT32_MAX) {
      throw new RangeError(`adapter id ${key} is out of range (0..${UINT32_MAX})`);
    }
    return { id, scale: value };
  }
  if (typeof key !== 'string' || key === '') {
    throw new TypeError(`adapter must be an id or a non-empty name, got ${JSON.stringify(key)}`);
  }
  return { name: key, scale: value };
}

// {adapter: scale} (or [[adapter, scale], ...]) -> AdapterMap, each adapter by id or by name
// (`adapterScale`): ids in id order, then names in the order given (as the Python client's
// clients/wire.py `adapter_map`); null/undefined -> undefined (unset: the default set).
function adapterMap(adapters) {
  if (adapters === null || adapters === undefined) return undefined;
  const pairs = Array.isArray(adapters) ? adapters : Object.entries(adapters);
  const entries = pairs.map(([key, scale]) => adapterScale(key, scale));
  const byId = entries.filter((e) => e.name === undefined).sort((a, b) => a.id - b.id);
  return { entries: [...byId, ...entries.filter((e) => e.name !== undefined)] };
}

function generateRequest({ prompt, promptTokens, adapters, maxTokens = 16, temperature = 0,
                           topK = 0, topP = 0, seed, requestId = '' }) {
  if ((prompt === undefined) === (promptTokens === undefined)) {
    throw new Error('give exactly one of prompt or promptTokens');
  }
  const req = {
    request_id: requestId,
    sampling: { max_tokens: maxTokens, temperature, top_k: topK, top_p: topP },
  };
  if (prompt !== undefined) req.text = prompt;
  else req.tokens = { ids: promptTokens };
  const amap = adapterMap(adapters);
  if (amap !== undefined) req.adapters = amap;
  if (seed !== undefined) req.sampling.seed = seed;
  return req;
}

// Call metadata carrying `authorization: Bearer <apiKey>` (a control plane started with
// --api-key; its admin token passes too); empty metadata when apiKey is empty/undefined.
function authMetadata(apiKey) {
  const md = new grpc.Metadata();
  if (apiKey) md.set('authorization', `Bearer ${apiKey}`);
  return md;
}

// Stream a generation. onToken(tokenEvent) is called for every token as it arrives.
// apiKey: the control plane's --api-key (default: $LORAPLANE_API_KEY).
// Resolves with {text, token_ids, prompt_token_ids, finish_reason, telemetry}.
async function generate(addr, options, { onToken, connectTimeoutMs = 5000,
                                         apiKey = process.env.LORAPLANE_API_KEY } = {}) {
  const client = createClient(addr);
  try {
    await waitReady(client, addr, connectTimeoutMs);
    return await new Promise((resolve, reject) => {
      const result = { text: '', token_ids: [], prompt_token_ids: [], finish_reason: '',
                       telemetry: null };
      const pieces = [];
      let finished = false;
      const call = client.Generate(generateRequest(options), authMetadata(apiKey));
      call.on('data', (ev) => {
        if (ev.event === 'started') {
          result.prompt_token_ids = ev.started.prompt_token_ids.map(Number);
        } else if (ev.event === 'token') {
          result.token_ids.push(Number(ev.token.token_id));
          pieces.push(ev.token.text);
          if (onToken) onToken(ev.token);
        } else if (ev.event === 'finished') {
          finished = true;
          result.finish_reason = ev.finished.finish_reason;
          result.text = ev.finished.text || pieces.join('');
          result.telemetry = ev.finished.telemetry;
        }
      });
      call.on('error', (err) => {
        reject(new LoraplaneError(STATUS_NAMES[err.code] || 'UNKNOWN', err.details || err.message));
      });
      call.on('end', () => {
        if (finished) resolve(result);
        else reject(new LoraplaneError('UNKNOWN', 'generation stream ended before finishing'));
      });
    });
  } finally {
    client.close();
  }
}

module.exports = {
  HTTP_NOT_GRPC,
  LoraplaneError,
  ServerUnreachable,
  PROTO_ROOTS,
  adapterMap,
  adapterScale,
  answersHttp1,
  authMetadata,
  createClient,
  findProtoRoot,
  generate,
  generateRequest,
  loadPackage,
  waitReady,
};
