#!/usr/bin/env node
// A Node.js client of switchboard's gRPC API: streams a Generate, calls Tokenize, and shows how a
// failed call's google.rpc.Status details (the grpc-status-details-bin trailer) are read.
//
//   npm ci && node client.js --target 127.0.0.1:50051 --max-tokens 16 "The capital of France is"
//   node client.js --chat "What is the capital of France?"   # a chat message, the model's template
//
// The protos come from the repository's proto/ folder (self-contained: google/rpc is vendored
// there; google/protobuf/* ship with the loader). Set SWITCHBOARD_PROTO_DIR to use a copy.
// With --json the last line of stdout is one JSON object (what the repository's test reads).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_DIR = process.env.SWITCHBOARD_PROTO_DIR || path.join(__dirname, "..", "..", "proto");

// The loader options that matter:
//  keepCase: true   field names as in the .proto (max_tokens, finish_reason); without it the
//                   loader camelCases them and snake_case fields you set are silently dropped
//  enums: String    enum values as their names ("FINISH_REASON_LENGTH"), not numbers
//  longs: String    64-bit integers (seed, Duration.seconds) as strings: a JS number loses bits
//  defaults: true   unset fields read as their default (0, "", []) instead of undefined
//  oneofs: true     a virtual field names the set member of a oneof (prompt: "text")
//  includeDirs      where imports such as "switchboard/v1/common.proto" are resolved
const LOADER_OPTIONS = {
  keepCase: true,
  enums: String,
  longs: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

function loadApi() {
  const definition = protoLoader.loadSync(
    ["switchboard/v1/generation_service.proto", "switchboard/v1/model_service.proto"],
    LOADER_OPTIONS,
  );
  return grpc.loadPackageDefinition(definition).switchboard.v1;
}

// google.rpc.Status and its details (ErrorInfo, BadRequest, RetryInfo), from proto/google/rpc.
let errorTypes = null;
function decodeStatusDetails(error) {
  const [bin] = (error.metadata && error.metadata.get("grpc-status-details-bin")) || [];
  if (!bin) return null;
  if (errorTypes === null) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(PROTO_DIR, target);
    root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], {
      keepCase: true,
    });
    errorTypes = root;
  }
  const status = errorTypes.lookupType("google.rpc.Status").decode(bin);
  return status.details.map((any) => {
    const type = errorTypes.lookupType(any.type_url.split("/").pop());
    return { type: type.fullName.replace(/^\./, ""), ...type.toObject(type.decode(any.value)) };
  });
}

function parseArgs(argv) {
  const args = {
    target: "127.0.0.1:50051",
    maxTokens: 16,
    ignoreEos: false,
    chat: false,
    json: false,
    prompt: null,
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--target") args.target = argv[++i];
    else if (arg === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (arg === "--ignore-eos") args.ignoreEos = true;
    else if (arg === "--chat") args.chat = true;
    else if (arg === "--json") args.json = true;
    else if (arg === "-h" || arg === "--help") {
      console.log(
        "usage: node client.js [--target HOST:PORT] [--max-tokens N] [--ignore-eos] [--chat] [--json] PROMPT",
      );
      process.exit(0);
    } else args.prompt = arg;
  }
  if (args.prompt === null) args.prompt = "The capital of France is";
  return args;
}

// Generate: one server-streaming call; OUTPUT_KIND_DELTA sends each step's new text. With
// --chat the prompt is one user message, rendered by the server with the model's chat template.
function generate(api, channel, args, onText) {
  const stub = new api.GenerationService(channel.target, channel.credentials);
  const prompt = args.chat
    ? { messages: [{ role: "user", content: args.prompt }] }
    : { text: args.prompt };
  const request = {
    ...prompt,
    sampling: { temperature: 0 }, // greedy
    stopping: { max_tokens: args.maxTokens, ignore_eos: args.ignoreEos },
    output: { kind: "OUTPUT_KIND_DELTA" },
  };
  return new Promise((resolve, reject) => {
    const result = { text: "", token_count: 0, finish_reason: null, usage: null, request_id: "" };
    const call = stub.Generate(request, { deadline: Date.now() + 60_000 });
    call.on("data", (response) => {
      result.request_id = response.request_id;
      for (const output of response.outputs) {
        result.text += output.text;
        onText(output.text);
        if (output.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
          result.finish_reason = output.finish_reason;
        }
      }
      if (response.usage) result.usage = response.usage;
    });
    call.on("error", reject);
    call.on("end", () => {
      result.token_count = result.usage ? result.usage.completion_tokens : 0;
      stub.close();
      resolve(result);
    });
  });
}

function unary(stub, method, request) {
  return new Promise((resolve, reject) =>
    stub[method](request, { deadline: Date.now() + 30_000 }, (error, response) =>
      error ? reject(error) : resolve(response),
    ),
  );
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const api = loadApi();
  const channel = { target: args.target, credentials: grpc.credentials.createInsecure() };

  const generated = await generate(api, channel, args, (text) => {
    if (!args.json) process.stdout.write(text);
  });
  if (!args.json) process.stdout.write("\n");

  const stub = new api.GenerationService(channel.target, channel.credentials);
  const tokenized = await unary(stub, "Tokenize", { text: args.prompt });

  // A refused request: INVALID_ARGUMENT, with a BadRequest naming the field in the details.
  let refused = null;
  try {
    await new Promise((resolve, reject) => {
      const call = stub.Generate({ text: "x", sampling: { top_p: 1.5 } });
      call.on("data", () => {});
      call.on("error", reject);
      call.on("end", resolve);
    });
  } catch (error) {
    refused = {
      code: grpc.status[error.code],
      details: error.details,
      status_details: decodeStatusDetails(error),
    };
  }
  stub.close();

  const summary = {
    text: generated.text,
    completion_tokens: generated.token_count,
    finish_reason: generated.finish_reason,
    usage: generated.usage,
    request_id: generated.request_id,
    prompt_token_ids: tokenized.token_ids,
    max_model_len: tokenized.max_model_len,
    refused,
  };
  if (args.json) console.log(JSON.stringify(summary));
  else {
    console.error(
      `[${generated.finish_reason}; ${generated.usage.prompt_tokens} prompt + ` +
        `${generated.token_count} completion tokens; id ${generated.request_id}]`,
    );
    console.error(`Tokenize: ${tokenized.token_ids.length} tokens: ${tokenized.token_ids}`);
    if (refused) console.error(`refused as expected: ${refused.code}: ${refused.details}`);
  }
}

main().catch((error) => {
  console.error(`error: ${grpc.status[error.code] || ""} ${error.details || error.message}`);
  process.exit(1);
});
