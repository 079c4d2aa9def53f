'use strict';
// Node.js client of the loraplane control plane.
//
// The .proto files in ../../protos are the contract: they are loaded at run time with
// @grpc/proto-loader (no generated code). Adapter maps follow the same rule as the Python
// client: `adapters` null/undefined leaves GenerateRequest.adapters unset (the control plane's
// default set); an object (even {}) sets an AdapterMap (exactly those adapters, others at 0).

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILE = 'loraplane/v1/control_plane.proto';

let cachedPackage = null;

function loadPackage() {
  if (cachedPackage === null) {
    const definition = protoLoader.loadSync(PROTO_FILE, {
      includeDirs: [PROTO_ROOT],
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

// Resolve when the channel is READY; reject with ServerUnreachable on the first connection
// failure (nothing listening, name not resolved) or after timeoutMs (as the Python client).
function waitReady(client, addr, timeoutMs) {
  const channel = client.getChannel();
  const deadline = Date.now() + timeoutMs;
  const { READY, TRANSIENT_FAILURE, SHUTDOWN } = grpc.connectivityState;
  return new Promise((resolve, reject) => {
    const check = () => {
      const state = channel.getConnectivityState(true);
      if (state === READY) return resolve();
      if (state === TRANSIENT_FAILURE || state === SHUTDOWN) {
        return reject(new ServerUnreachable(addr, 'connection failed (is the server running '
          + 'and the address right?)'));
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

// {id: scale} (or [[id, scale], ...]) -> AdapterMap; null/undefined -> undefined (unset).
function adapterMap(adapters) {
  if (adapters === null || adapters === undefined) return undefined;
  const pairs = Array.isArray(adapters) ? adapters : Object.entries(adapters);
  const entries = pairs
    .map(([id, scale]) => ({ id: Number(id), scale: Number(scale) }))
    .sort((a, b) => a.id - b.id);
  return { entries };
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
  LoraplaneError,
  ServerUnreachable,
  PROTO_ROOT,
  adapterMap,
  authMetadata,
  createClient,
  generate,
  generateRequest,
  loadPackage,
  waitReady,
};
