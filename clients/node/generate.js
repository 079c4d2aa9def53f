#!/usr/bin/env node
'use strict';
// Stream one generation from a loraplane control plane and print one JSON line:
//   {"text": "...", "token_ids": [...]}
//
//   node clients/node/generate.js --addr HOST:PORT --prompt TEXT [--lora ID|NAME=SCALE]...
//                                 [--no-lora] [--prompt-tokens ID,ID,...] [--max-tokens N]
//                                 [--temperature T] [--seed S] [--stream] [--api-key KEY]
//
// --api-key (default $LORAPLANE_API_KEY): the control plane's inference API key.
// No --lora and no --no-lora: the control plane's default adapter set; --no-lora: no adapters;
// --lora: exactly those adapters, every other one at 0, each by id (ASCII digits) or by name /
// alias (resolved by the control plane: an unknown name is NOT_FOUND, exit 1). --stream echoes token pieces to stderr
// as they arrive. Exit codes as the loraplane CLI: 0 ok, 1 server refused (error JSON on
// stdout), 2 usage error, 3 server unreachable.

const { parseArgs } = require('util');
const { adapterScale, generate, LoraplaneError, ServerUnreachable } = require('./loraplane');

const USAGE = 'usage: generate.js --addr HOST:PORT (--prompt TEXT | --prompt-tokens ID,ID,...) '
  + '[--lora ID|NAME=SCALE]... [--no-lora] [--max-tokens N] [--temperature T] [--seed S] [--stream] '
  + '[--api-key KEY]';

class UsageError extends Error {}

// ID=SCALE or NAME=SCALE (the last '=' splits, as the loraplane CLI) -> [key, scale], the key
// as the library reads it (adapterScale: ASCII digits an id, anything else a name).
function parseLora(text) {
  const at = text.lastIndexOf('=');
  const key = text.slice(0, at); // untrimmed, as the CLI: " 3" is a name, not id 3
  const scaleText = text.slice(at + 1).trim();
  const scale = Number(scaleText);
  if (at < 0 || key === '' || scaleText === '' || !Number.isFinite(scale)) {
    throw new UsageError(`--lora: ${JSON.stringify(text)} is not ID=SCALE or NAME=SCALE (e.g. 0=1.0, shout=0.5)`);
  }
  try {
    adapterScale(key, scale);
  } catch (err) {
    throw new UsageError(`--lora: ${JSON.stringify(text)}: ${err.message}`);
  }
  return [key, scale];
}

function parseIntOption(name, text, min) {
  if (!/^\d+$/.test(text) || Number(text) < min) {
    throw new UsageError(`${name}: ${JSON.stringify(text)} is not an integer >= ${min}`);
  }
  return Number(text);
}

function parseCommandLine(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        addr: { type: 'string', default: process.env.LORAPLANE_ADDR || '127.0.0.1:50051' },
        prompt: { type: 'string' },
        'prompt-tokens': { type: 'string' },
        lora: { type: 'string', multiple: true, default: [] },
        'no-lora': { type: 'boolean', default: false },
        'max-tokens': { type: 'string', default: '16' },
        temperature: { type: 'string', default: '0' },
        seed: { type: 'string' },
        stream: { type: 'boolean', default: false },
        'api-key': { type: 'string', default: process.env.LORAPLANE_API_KEY || '' },
        help: { type: 'boolean', short: 'h', default: false },
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (err) {
    throw new UsageError(err.message);
  }
  if (values.help) return { help: true };
  if ((values.prompt === undefined) === (values['prompt-tokens'] === undefined)) {
    throw new UsageError('give exactly one of --prompt or --prompt-tokens');
  }
  if (values.lora.length && values['no-lora']) {
    throw new UsageError('--lora and --no-lora exclude each other');
  }
  let adapters;
  if (values['no-lora']) adapters = {};
  if (values.lora.length) {
    adapters = values.lora.map(parseLora); // [[key, scale], ...]: any name, '__proto__' too
    const seen = new Set();
    for (const [key] of adapters) {
      if (seen.has(key)) throw new UsageError(`--lora: adapter ${key} given twice`);
      seen.add(key);
    }
  }
  let promptTokens;
  if (values['prompt-tokens'] !== undefined) {
    promptTokens = values['prompt-tokens'].split(',').filter((s) => s.trim() !== '')
      .map((s) => parseIntOption('--prompt-tokens', s.trim(), 0));
    if (!promptTokens.length) throw new UsageError('--prompt-tokens: no token ids given');
  }
  const temperature = Number(values.temperature);
  if (!Number.isFinite(temperature) || temperature < 0) {
    throw new UsageError(`--temperature: ${JSON.stringify(values.temperature)} is not >= 0`);
  }
  return {
    addr: values.addr,
    stream: values.stream,
    apiKey: values['api-key'],
    request: {
      prompt: values.prompt,
      promptTokens,
      adapters,
      maxTokens: parseIntOption('--max-tokens', values['max-tokens'], 1),
      temperature,
      seed: values.seed === undefined ? undefined : parseIntOption('--seed', values.seed, 0),
    },
  };
}

async function main() {
  let cmd;
  try {
    cmd = parseCommandLine(process.argv.slice(2));
  } catch (err) {
    if (!(err instanceof UsageError)) throw err;
    process.stderr.write(`${USAGE}\nerror: ${err.message}\n`);
    return 2;
  }
  if (cmd.help) {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  const onToken = cmd.stream ? (tok) => process.stderr.write(tok.text) : undefined;
  try {
    const result = await generate(cmd.addr, cmd.request, { onToken, apiKey: cmd.apiKey });
    if (cmd.stream) process.stderr.write('\n');
    process.stdout.write(`${JSON.stringify({ text: result.text, token_ids: result.token_ids })}\n`);
    return 0;
  } catch (err) {
    if (!(err instanceof LoraplaneError)) throw err;
    process.stdout.write(`${JSON.stringify({ error: { code: err.code, message: err.details } })}\n`);
    return err instanceof ServerUnreachable ? 3 : 1;
  }
}

main().then(
  (code) => { process.exitCode = code; },
  (err) => {
    process.stderr.write(`generate.js: internal error: ${err && err.message}\n`);
    process.exitCode = 1;
  },
);
