// attnctl: the command-line client of attnserve.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/build_info.h"
#include "cli/command_line.h"
#include "cli/file_io.h"
#include "cli/npy.h"
#include "client/attend_report.h"
#include "client/attention_client.h"
#include "client/bench.h"
#include "client/decode_bench.h"
#include "client/decode_churn.h"
#include "client/request_builder.h"
#include "client/session_command.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "attnserve gRPC address: host:port; replicas as a comma-separated list of IP "
          "address:port (127.0.0.1:5001,127.0.0.1:5002); or a gRPC URI (dns:///name:port, "
          "ipv4:10.0.0.1:50051,10.0.0.2:50051)");
ABSL_FLAG(std::string, lb_policy, "",
          "Load balancing over the addresses --target resolves to: round_robin (calls spread "
          "over every replica that reports SERVING), pick_first, or empty (gRPC's default, "
          "pick_first)");
ABSL_FLAG(std::string, lb_health_check_service,
          attnserve::client::ClientOptions().health_check_service,
          "With --lb_policy=round_robin: the grpc.health.v1 service watched on each replica; "
          "calls go only to replicas that report it SERVING (empty: no client-side health "
          "checking)");
ABSL_FLAG(int, max_attempts, attnserve::client::RetryOptions().max_attempts,
          "Attempts per call, retries of UNAVAILABLE included (1: no retries; at most 5); "
          "with --lb_policy=round_robin a retry goes to another replica");
ABSL_FLAG(double, timeout_seconds, 30, "Deadline of each call, retries included");
ABSL_FLAG(int64_t, max_receive_message_bytes,
          attnserve::client::ClientOptions().max_receive_message_bytes,
          "Largest response accepted, in bytes (outputs and attention maps can be large); a "
          "larger one fails with RESOURCE_EXHAUSTED naming this flag. Requests are limited by "
          "the server's own --max_receive_message_bytes");
ABSL_FLAG(std::string, tls_ca, "",
          "Use TLS; PEM CA bundle that signed the server's certificate (with --tls_cert alone: "
          "the system roots)");
ABSL_FLAG(std::string, tls_cert, "", "Use TLS; PEM client certificate for mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name checked against the server's certificate instead of --target's host");
ABSL_FLAG(std::string, token_file, "",
          "File holding the bearer token (first line) sent as 'authorization: Bearer <token>'; "
          "read from a file so it does not show in ps");
ABSL_FLAG(std::string, routing_key, "",
          "Sent as 'attnserve-routing-key' on every call: behind the shipped proxy, calls with "
          "one key reach one replica, so give a session's key to each of its commands "
          "(session open, extend, get, fork, truncate, close); printable ASCII");
ABSL_FLAG(std::string, model, "default", "attend/model: the model to use");
ABSL_FLAG(std::string, service, "",
          "health: the service to check (\"\" = the whole server, or "
          "attnserve.v1.AttentionService)");

// attend: the inputs.
ABSL_FLAG(int64_t, batch, 0,
          "attend: sequences in the request (0: from --input or --lengths, else 1)");
ABSL_FLAG(int64_t, seq, 0,
          "attend: tokens per sequence, padded (0: from --input, else max of --lengths, else 16)");
ABSL_FLAG(uint64_t, seed, 1,
          "attend: seed of the random hidden states, context and projected heads (normal, std 1)");
ABSL_FLAG(
    std::string, input, "",
    "attend: .npy file of hidden states instead of random ones: [batch, seq, d_model], or packed "
    "[tokens, d_model] with --lengths; float32, or float64/float16/integers converted to float32 "
    "(said on stderr)");
ABSL_FLAG(attnserve::client::Int64List, lengths, {},
          "attend: per-sequence query lengths, e.g. 3,5,8 (sequence_lengths; ragged batch)");
ABSL_FLAG(
    bool, packed, false,
    "attend: send the hidden states (and context) packed [total tokens, d_model]; needs --lengths");
ABSL_FLAG(int64_t, context_seq, 0,
          "attend: cross-attention to random context states of this many tokens per sequence "
          "(with --projected: the keys' length)");
ABSL_FLAG(attnserve::client::Int64List, context_lengths, {},
          "attend: per-sequence context lengths (cross-attention; required with --packed)");
ABSL_FLAG(bool, projected, false,
          "attend: send random already-projected q/k/v (the attention core alone) instead of "
          "hidden states; shapes from the head configuration");

// attend: how attention runs.
ABSL_FLAG(bool, causal, false, "attend: query i sees only keys j <= i");
ABSL_FLAG(std::string, mask, "",
          "attend: .npy mask [batch or 1, seq_q or 1, seq_kv or 1]: bool or uint8, or float32 "
          "(float64/float16/integers converted to float32, said on stderr)");
ABSL_FLAG(std::string, mask_kind, "",
          "attend: allowed (nonzero = may attend; the default) or additive ('<f4' added to the "
          "scores, -inf forbids)");
ABSL_FLAG(attnserve::client::FloatList, head_mask, {},
          "attend: one gate per head, e.g. 1,0,1,1 (0 removes the head)");
ABSL_FLAG(attnserve::client::Int64List, position_offsets, {},
          "attend: RoPE position of each sequence's first token, one per sequence");
ABSL_FLAG(std::string, precision, "fp32", "attend: compute precision: fp32 or bf16");
ABSL_FLAG(std::string, output_dtype, "fp32", "attend: dtype of output and maps: fp32 or bf16");
ABSL_FLAG(std::string, input_dtype, "fp32",
          "attend: dtype of the hidden and context states sent: fp32 or bf16 (rounded to nearest "
          "even; half the bytes)");

// attend: an ad-hoc layer instead of --model.
ABSL_FLAG(std::optional<uint64_t>, layer_seed, std::nullopt,
          "attend: run an ad-hoc layer with the documented seeded weights of this seed instead of "
          "--model (needs --d_model and --num_heads)");
ABSL_FLAG(int32_t, d_model, 0, "attend --layer_seed: model width");
ABSL_FLAG(int32_t, num_heads, 0, "attend --layer_seed: query heads");
ABSL_FLAG(int32_t, num_kv_heads, 0, "attend --layer_seed: key/value heads (0: num_heads)");
ABSL_FLAG(int32_t, head_dim, 0, "attend --layer_seed: per-head width (0: d_model / num_heads)");
ABSL_FLAG(int32_t, rotary_dim, 0, "attend --layer_seed: RoPE dimensions per head (0: no RoPE)");
ABSL_FLAG(float, rope_theta, 0, "attend --layer_seed: RoPE base (0: 10000)");

// attend: what to return and keep.
ABSL_FLAG(std::string, maps, "none", "attend: attention maps to return: none, per-head or mean");
ABSL_FLAG(attnserve::client::Int64List, heads, {},
          "attend --maps=per-head: only these heads, e.g. 0,3");
ABSL_FLAG(attnserve::client::Int64List, rows, {},
          "attend --maps: only these query positions, e.g. 5");
ABSL_FLAG(bool, stream_maps, false,
          "attend: call AttendStream: the maps come in chunks of at most 1 MiB and are put back "
          "together here (maps larger than one message; the server's --max_attention_map_bytes "
          "still bounds them)");
ABSL_FLAG(bool, stats, false,
          "attend: per-head statistics (entropy, max weight, contribution), printed as a table; "
          "session extend: each new row's entropy and max weight per head");
ABSL_FLAG(std::string, save_output, "", "attend: write the output to this .npy file ('<f4')");
ABSL_FLAG(std::string, save_maps, "",
          "attend, session latest: write the maps to this .npy file ('<f4')");
ABSL_FLAG(std::string, maps_png, "",
          "attend: draw the maps as a heatmap PNG, one tile per head (one for --maps=mean)");
ABSL_FLAG(int64_t, png_sequence, 0, "attend --maps_png: the batch entry to draw");
ABSL_FLAG(int64_t, concurrency, 0,
          "bench: closed loop, this many calls outstanding at all times");
ABSL_FLAG(double, rate, 0, "bench: open loop, start this many calls per second");
ABSL_FLAG(bool, decode, false,
          "bench: drive decode sessions instead of Attend: open --sessions over --model, prefill "
          "each with --context tokens, then --steps rounds of one token per session (one Extend "
          "a round); prints tokens/s and step latency");
ABSL_FLAG(int64_t, sessions, 8, "bench --decode: sessions decoding together");
ABSL_FLAG(int64_t, context, 512, "bench --decode: tokens each session is prefilled with");
ABSL_FLAG(int64_t, steps, 32, "bench --decode: decode rounds (one new token per session each)");
ABSL_FLAG(int64_t, prefill_chunk, 512, "bench --decode: most tokens a session sends per prefill step");
ABSL_FLAG(int64_t, prefill_during, 0,
          "bench --decode: mixed traffic: after --steps rounds, as many again with one prefill "
          "of this many tokens (one Extend step of a new session) arriving among them; reports "
          "the step p50/p99 without and with it, and the p99 ratio (0: off)");
ABSL_FLAG(std::string, kv_dtype, "fp32", "bench --decode: the sessions' KV cache: fp32 or bf16");
ABSL_FLAG(bool, stream, false,
          "bench --decode: send the prefill and the rounds as messages of one ExtendStream call "
          "instead of one Extend call each (compare the two forms' step latency)");
ABSL_FLAG(bool, churn, false,
          "bench --decode: churn the session table for --duration seconds instead: open, extend "
          "(decode tokens and short prefills), fork, truncate, close and park sessions at random, "
          "at most --sessions live of at most --context tokens, a quarter with an idle TTL of "
          "--ttl_seconds (default 1); checks every answer's length (exit 1 on a lost or "
          "duplicated token or an undocumented refusal)");

// session: decode sessions, one verb a command.
ABSL_FLAG(std::string, session_id, "", "session extend/get/fork/truncate/close: the session");
ABSL_FLAG(int64_t, tokens, 0,
          "session extend: append this many random new tokens (normal, seeded by --seed); or "
          "--input");
ABSL_FLAG(int, layer, -1,
          "session extend, latest: the session's layer (default 0); session truncate: the layer to "
          "truncate (default: every layer)");
ABSL_FLAG(int64_t, expected_length, -1,
          "session extend: the layer's length the step expects (default: as the server says "
          "now); a repeated step with the same inputs is replayed, not appended twice");
ABSL_FLAG(int64_t, length, -1, "session truncate: tokens to keep");
ABSL_FLAG(int64_t, max_tokens, 0,
          "session open: tokens each layer may hold (0: the server's --max_session_tokens)");
ABSL_FLAG(double, ttl_seconds, 0,
          "session open: idle time-to-live (0: the server's --session_ttl_seconds)");
ABSL_FLAG(int64_t, first_position, 0, "session open: the RoPE position of the first token");
ABSL_FLAG(double, duration, 10, "bench: seconds to run (unless --requests)");
ABSL_FLAG(int64_t, requests, 0, "bench: calls to send (0: run for --duration)");
ABSL_FLAG(bool, json, false,
          "attend, bench, models, model, session: print the result as one JSON object on one "
          "line (models, model and session: the server's answer -- ListModelsResponse, "
          "ModelInfo, Session, ExtendResponse -- in protobuf's JSON mapping, int64 as strings)");
ABSL_FLAG(int64_t, repeat, 1,
          "attend: send the request this many times and report latency percentiles");

namespace attnserve::client {

using ::attnserve::cli::NpyArray;
using ::attnserve::cli::NpyConversionNote;
using ::attnserve::cli::ReadNpyHeader;

namespace {

constexpr char kUsage[] = R"(the command-line client of attnserve.

Usage: attnctl <command> [--target=host:port] [flags]
       attnctl <command> --target=ip:port,ip:port,... --lb_policy=round_robin [flags]
Commands:
  models                  list the loaded models and their head configurations
  model --model=M         describe one model
  load --model=M          load (or retry) folder M of the server's model repository
                          and wait until it is READY (admin)
  unload --model=M        unload model M; calls running on it finish (admin)
  attend [flags]          run attention once (or --repeat=N times) and print what
                          ran (model or ad-hoc layer, kernel, the precision that
                          ran), the inputs, the output's first values, per-head map
                          row sums, and latency percentiles with --repeat
  health [--service=S]    print the server's health (exit 0 only when SERVING)
  session open [--model=M[,M2,...]] [--kv_dtype=fp32|bf16] [--max_tokens=N]
          [--ttl_seconds=S] [--first_position=P]
                          open a decode session over a model (or a network's layers);
                          prints its id on the first line
  session extend --session_id=ID (--tokens=N | --input=X.npy) [--layer=L]
          [--expected_length=E] [--head_mask=..] [--precision=..] [--save_output=O.npy]
          [--stats]
                          append N random tokens (or X's rows [n, d_model]) to a layer
                          and print the new length and the output's first values
                          (--stats: each new row's entropy and max weight per head)
  session get|fork|close --session_id=ID
                          describe the session; fork it (prints the new one); end it
  session latest --session_id=ID [--layer=L] [--save_maps=M.npy]
                          what the layer's latest token attends to: each head's entropy,
                          max weight and the keys it weighs most (--save_maps: the maps
                          [heads, length])
  session truncate --session_id=ID --length=N [--layer=L]
                          keep the first N tokens of every layer (or of layer L)
  help                    print this text (as --help does)
  bench [flags]           load generator: send the request that attend's flags describe,
                          closed loop (--concurrency=N calls outstanding) or open loop
                          (--rate=R calls/s), for --duration=S seconds or --requests=N;
                          prints throughput, p50/p90/p99/max latency, errors by status
                          code and the server's queue/compute/batch means (--json: one
                          JSON object); progress on stderr
  bench --decode [flags]  decode sessions: --sessions=N over --model, each prefilled with
                          --context=C tokens, then --steps=K rounds of one token per
                          session, one Extend (micro-batch) a round (--stream: messages
                          of one ExtendStream call); prints tokens/s, step
                          p50/p90/p99/max and the server's compute per step;
                          --prefill_during=N: as many rounds again with one N-token
                          prefill arriving among them, and the p99 with / without
  bench --decode --churn [flags]  open, extend, fork, truncate, close sessions at random
                          for --duration=S, checking every length (no token lost or
                          duplicated); sessions expire (--ttl_seconds) and are evicted

attend flags (attnctl --help describes each one):
  what runs    --model=M | --layer_seed=N --d_model=D --num_heads=H [--num_kv_heads=K]
               [--head_dim=E] [--rotary_dim=R] [--rope_theta=T]
  inputs       random (--seed) hidden states [--batch, --seq, d_model], or --input=X.npy;
               --lengths=3,5,8 (ragged) [--packed]; --context_seq=N [--context_lengths=..]
               (cross-attention); --projected (random q/k/v, the attention core alone)
  attention    --causal, --mask=M.npy [--mask_kind=allowed|additive], --head_mask=1,0,..,
               --position_offsets=.., --precision=fp32|bf16, --output_dtype=fp32|bf16,
               --input_dtype=fp32|bf16
  results      --maps=none|per-head|mean [--heads=0,3] [--rows=5], --stats (per-head table),
               --save_output=O.npy, --save_maps=M.npy, --maps_png=M.png [--png_sequence=b]
Examples:
  attnctl attend --batch=2 --seq=8 --maps=per-head --maps_png=/tmp/maps.png
  attnctl attend --lengths=3,5,8 --packed --causal --stats
  attnctl attend --layer_seed=7 --d_model=64 --num_heads=4 --num_kv_heads=2 --rotary_dim=16 \
      --position_offsets=0 --seq=12 --maps=mean
  attnctl bench --concurrency=32 --batch=1 --seq=128 --duration=20
  attnctl bench --rate=500 --batch=1 --seq=16 --requests=5000 --json
  attnctl bench --decode --sessions=32 --context=2048 --steps=64
  attnctl bench --decode --sessions=1 --context=2048 --steps=256 --stream
  attnctl bench --decode --sessions=32 --context=2048 --prefill_during=4096
  ID=$(attnctl session open | head -1); attnctl session extend --session_id=$ID --tokens=4
  attnctl attend --target=127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003 \
      --lb_policy=round_robin --repeat=300      # spread over three replicas

--json prints the result of attend, bench, models, model and session as one JSON object.
Exit status: 0 done (health: SERVING); 1 a call failed (health: not SERVING) or a
file could not be read or written; 2 the command line is wrong (unknown command
or flag, a value that does not parse, flags that do not fit together).
)";

// A failed call or file: exit 1.
int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", status.ToString().c_str());
  return cli::kExitFailure;
}

// A command line that cannot work, found before any call: exit 2.
int UsageFail(const absl::Status& status) {
  return cli::UsageError("attnctl", status.ToString());
}

// Prints `message` as one JSON line (--json).
int PrintJson(const google::protobuf::Message& message) {
  absl::StatusOr<std::string> json = JsonLine(message);
  if (!json.ok()) return Fail(json.status());
  std::printf("%s\n", json->c_str());
  return cli::kExitOk;
}

// Says on stderr when --input or --mask is converted as it is read (float64
// -> float32, ...). From the file's header; a file that cannot be read is
// reported when the request is built.
void NoteNpyConversion(const std::string& path) {
  if (path.empty()) return;
  absl::StatusOr<NpyArray> header = ReadNpyHeader(path);
  if (!header.ok()) return;
  const std::string note = NpyConversionNote(*header);
  if (!note.empty()) std::fprintf(stderr, "attnctl: %s: %s\n", path.c_str(), note.c_str());
}

void PrintModel(const v1::ModelInfo& model) {
  if (model.state() == v1::MODEL_STATE_LOADING || model.state() == v1::MODEL_STATE_FAILED) {
    std::printf("%s  [%s]\n", model.name().c_str(),
                model.state() == v1::MODEL_STATE_LOADING ? "LOADING" : "FAILED");
    if (!model.failure_reason().empty()) std::printf("  %s\n", model.failure_reason().c_str());
    return;
  }
  const v1::HeadConfig& h = model.head_config();
  std::printf("%s  [READY]%s\n  d_model %d, heads %d, kv heads %d, head_dim %d, scale %.6g\n",
              model.name().c_str(), model.causal() ? " causal" : "", h.d_model(), h.num_heads(), h.num_kv_heads(), h.head_dim(),
              h.scale());
  std::printf("  limits: batch <= %lld, seq <= %lld, maps <= %lld bytes\n",
              static_cast<long long>(model.limits().max_batch()),
              static_cast<long long>(model.limits().max_seq_len()),
              static_cast<long long>(model.limits().max_attention_map_bytes()));
  if (!model.description().empty()) std::printf("  %s\n", model.description().c_str());
}

int RunModels(const AttentionClient& client) {
  absl::StatusOr<v1::ListModelsResponse> models = client.ListModels();
  if (!models.ok()) return Fail(models.status());
  if (absl::GetFlag(FLAGS_json)) return PrintJson(*models);
  if (models->models().empty()) std::printf("(no models loaded)\n");
  for (const v1::ModelInfo& model : models->models()) PrintModel(model);
  return 0;
}

int RunModel(const AttentionClient& client) {
  absl::StatusOr<v1::ModelInfo> model = client.GetModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  if (absl::GetFlag(FLAGS_json)) return PrintJson(*model);
  PrintModel(*model);
  return 0;
}

int RunLoad(const AttentionClient& client) {
  absl::StatusOr<v1::LoadModelResponse> loaded = client.LoadModel(absl::GetFlag(FLAGS_model));
  if (!loaded.ok()) return Fail(loaded.status());
  if (loaded->layers_size() > 0) {  // a folder of layers: each layer's model
    for (const v1::ModelInfo& layer : loaded->layers()) PrintModel(layer);
    return 0;
  }
  PrintModel(loaded->model());
  return 0;
}

int RunUnload(const AttentionClient& client) {
  if (absl::Status s = client.UnloadModel(absl::GetFlag(FLAGS_model)); !s.ok()) return Fail(s);
  std::printf("unloaded %s\n", absl::GetFlag(FLAGS_model).c_str());
  return 0;
}

int RunHealth(const AttentionClient& client) {
  auto status = client.CheckHealth(absl::GetFlag(FLAGS_service));
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// A one-line progress bar on stderr, redrawn in place when it is a terminal.
void ShowProgress(int64_t done, int64_t total) {
  if (!isatty(STDERR_FILENO) || total < 2) return;
  std::fprintf(stderr, "\r%s %lld/%lld",
               ProgressBar(static_cast<double>(done) / static_cast<double>(total)).c_str(),
               static_cast<long long>(done), static_cast<long long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

AttendOptions AttendOptionsFromFlags() {
  AttendOptions o;
  o.model = absl::GetFlag(FLAGS_model);
  o.layer_seed = absl::GetFlag(FLAGS_layer_seed);
  o.d_model = absl::GetFlag(FLAGS_d_model);
  o.num_heads = absl::GetFlag(FLAGS_num_heads);
  o.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.rotary_dim = absl::GetFlag(FLAGS_rotary_dim);
  o.rope_theta = absl::GetFlag(FLAGS_rope_theta);
  o.batch = absl::GetFlag(FLAGS_batch);
  o.seq = absl::GetFlag(FLAGS_seq);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.input = absl::GetFlag(FLAGS_input);
  o.packed = absl::GetFlag(FLAGS_packed);
  o.lengths = absl::GetFlag(FLAGS_lengths).values;
  o.context_seq = absl::GetFlag(FLAGS_context_seq);
  o.context_lengths = absl::GetFlag(FLAGS_context_lengths).values;
  o.causal = absl::GetFlag(FLAGS_causal);
  o.mask = absl::GetFlag(FLAGS_mask);
  o.mask_kind = absl::GetFlag(FLAGS_mask_kind);
  o.head_mask = absl::GetFlag(FLAGS_head_mask).values;
  o.position_offsets = absl::GetFlag(FLAGS_position_offsets).values;
  o.precision = absl::GetFlag(FLAGS_precision);
  o.output_dtype = absl::GetFlag(FLAGS_output_dtype);
  o.input_dtype = absl::GetFlag(FLAGS_input_dtype);
  o.projected = absl::GetFlag(FLAGS_projected);
  o.maps = absl::GetFlag(FLAGS_maps);
  o.heads = absl::GetFlag(FLAGS_heads).values;
  o.rows = absl::GetFlag(FLAGS_rows).values;
  o.stats = absl::GetFlag(FLAGS_stats);
  o.save_output = absl::GetFlag(FLAGS_save_output);
  o.save_maps = absl::GetFlag(FLAGS_save_maps);
  o.maps_png = absl::GetFlag(FLAGS_maps_png);
  o.png_sequence = absl::GetFlag(FLAGS_png_sequence);
  return o;
}

// The request `options` describe; a named model's head configuration comes
// from the server (GetModel), a seeded ad-hoc layer needs none.
absl::StatusOr<AttendCall> AttendCallFor(const AttentionClient& client,
                                         const AttendOptions& options) {
  std::optional<v1::ModelInfo> model;
  if (!options.layer_seed.has_value()) {
    absl::StatusOr<v1::ModelInfo> info = client.GetModel(options.model);
    if (!info.ok()) return info.status();
    model = *std::move(info);
  }
  return BuildAttendRequest(options, model.has_value() ? &model->head_config() : nullptr);
}

int RunAttend(const AttentionClient& client) {
  const AttendOptions options = AttendOptionsFromFlags();
  const int64_t repeat = absl::GetFlag(FLAGS_repeat);
  if (repeat <= 0) return UsageFail(absl::InvalidArgumentError("--repeat: must be >= 1"));
  // Flag mistakes first, before any call.
  if (absl::Status status = ValidateAttendOptions(options); !status.ok()) return UsageFail(status);
  NoteNpyConversion(options.input);
  NoteNpyConversion(options.mask);
  absl::StatusOr<AttendCall> call = AttendCallFor(client, options);
  if (!call.ok()) return Fail(call.status());

  std::vector<double> latencies_ms, transports_ms;
  absl::StatusOr<v1::AttendResponse> response;
  const bool stream_maps = absl::GetFlag(FLAGS_stream_maps);
  int64_t chunks = 0;
  // Attend's request is prepared once (one copy): each call then sends its
  // tensors without copying them (WireRequest).
  std::optional<WireRequest> wire;
  if (!stream_maps) wire.emplace(v1::AttendRequest(call->request));
  // Each call's answer is read into the last one's memory (Attend(const
  // WireRequest&, AttendResponse*)).
  if (!stream_maps) response.emplace();
  for (int64_t i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (stream_maps) {
      response = client.AttendStream(call->request, &chunks);
    } else if (absl::Status status = client.Attend(*wire, &*response); !status.ok()) {
      response = status;
    }
    latencies_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
    if (!response.ok()) return Fail(response.status());
    transports_ms.push_back(latencies_ms.back() - DurationMillis(response->timing().compute()));
    ShowProgress(i + 1, repeat);
  }

  std::sort(latencies_ms.begin(), latencies_ms.end());
  std::sort(transports_ms.begin(), transports_ms.end());
  if (absl::GetFlag(FLAGS_json)) {
    absl::StatusOr<std::vector<std::string>> written = SaveAttendFiles(options, *call, *response);
    if (!written.ok()) return Fail(written.status());
    absl::StatusOr<std::string> json = FormatAttendJson(*call, *response, latencies_ms, transports_ms, *written);
    if (!json.ok()) return Fail(json.status());
    std::printf("%s\n", json->c_str());
    return cli::kExitOk;
  }
  std::printf("%s", FormatAttendSummary(*call, *response).c_str());
  std::printf("server: queue %s, compute %s\n", DurationText(response->timing().queue()).c_str(),
              DurationText(response->timing().compute()).c_str());
  if (stream_maps) std::printf("maps streamed in %lld chunks\n", static_cast<long long>(chunks));
  if (repeat == 1) {
    std::printf("round trip %.3f ms\n", latencies_ms[0]);
  } else {
    std::printf("round trip over %lld calls: p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms\n",
                static_cast<long long>(repeat), Percentile(latencies_ms, 50), Percentile(latencies_ms, 90),
                Percentile(latencies_ms, 99),
                latencies_ms.back());
  }
  absl::StatusOr<std::vector<std::string>> written = SaveAttendFiles(options, *call, *response);
  if (!written.ok()) return Fail(written.status());
  for (const std::string& line : *written) std::printf("%s\n", line.c_str());
  return 0;
}

int RunDecodeBenchCommand(const AttentionClient& client) {
  DecodeBenchOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  options.sessions = absl::GetFlag(FLAGS_sessions);
  options.context = absl::GetFlag(FLAGS_context);
  options.steps = absl::GetFlag(FLAGS_steps);
  options.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.prefill_during = absl::GetFlag(FLAGS_prefill_during);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.stream = absl::GetFlag(FLAGS_stream);
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout_seconds);
  const std::string kv = absl::GetFlag(FLAGS_kv_dtype);
  if (kv != "fp32" && kv != "bf16") {
    return UsageFail(absl::InvalidArgumentError("--kv_dtype: fp32 or bf16"));
  }
  options.kv_dtype = kv == "bf16" ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_FP32;
  if (absl::Status status = ValidateDecodeBenchOptions(options); !status.ok()) {
    return UsageFail(status);
  }
  const bool tty = isatty(STDERR_FILENO);
  absl::StatusOr<DecodeBenchResult> result =
      RunDecodeBench(client, options, [tty](int64_t done, int64_t total) {
        const double fraction = static_cast<double>(done) / static_cast<double>(total);
        if (tty) {
          std::fprintf(stderr, "\r%s %3.0f%% %lld of %lld calls", ProgressBar(fraction).c_str(),
                       100 * fraction, static_cast<long long>(done),
                       static_cast<long long>(total));
        } else if (done == total || done % 16 == 0) {
          std::fprintf(stderr, "bench --decode: %lld of %lld calls\n",
                       static_cast<long long>(done), static_cast<long long>(total));
        }
      });
  if (tty) std::fprintf(stderr, "\n");
  if (!result.ok()) return Fail(result.status());
  std::printf("%s\n", absl::GetFlag(FLAGS_json) ? FormatDecodeBenchJson(*result).c_str()
                                                : FormatDecodeBenchText(*result).c_str());
  return 0;
}

int RunDecodeChurnCommand(const AttentionClient& client) {
  DecodeChurnOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  options.duration_seconds = absl::GetFlag(FLAGS_duration);
  options.sessions = absl::GetFlag(FLAGS_sessions);
  options.context = absl::GetFlag(FLAGS_context);
  const double ttl = absl::GetFlag(FLAGS_ttl_seconds);
  options.short_ttl_seconds = ttl > 0 ? ttl : 1.0;
  options.seed = absl::GetFlag(FLAGS_seed);
  if (absl::Status status = ValidateDecodeChurnOptions(options); !status.ok()) {
    return UsageFail(status);
  }
  absl::StatusOr<DecodeChurnResult> result =
      RunDecodeChurn(client, options, [](const DecodeChurnResult& r, int64_t live) {
        int64_t operations = 0;
        for (const auto& [kind, count] : r.operations) operations += count;
        std::fprintf(stderr,
                     "bench --decode --churn: %.0f s, %lld operations, %lld tokens, %lld live "
                     "sessions, %lld failures\n",
                     r.seconds, static_cast<long long>(operations),
                     static_cast<long long>(r.tokens_appended), static_cast<long long>(live),
                     static_cast<long long>(r.failures));
      });
  if (!result.ok()) return Fail(result.status());
  std::printf("%s\n", absl::GetFlag(FLAGS_json) ? FormatDecodeChurnJson(*result).c_str()
                                                : FormatDecodeChurnText(*result).c_str());
  return result->failures == 0 ? cli::kExitOk : cli::kExitFailure;
}

int RunSessionCommandLine(const AttentionClient& client, const std::string& verb) {
  SessionCommand command;
  command.verb = verb;
  command.models = absl::StrSplit(absl::GetFlag(FLAGS_model), ',');
  command.kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  command.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  command.ttl_seconds = absl::GetFlag(FLAGS_ttl_seconds);
  command.first_position = absl::GetFlag(FLAGS_first_position);
  command.session_id = absl::GetFlag(FLAGS_session_id);
  command.layer = absl::GetFlag(FLAGS_layer);
  command.tokens = absl::GetFlag(FLAGS_tokens);
  command.input = absl::GetFlag(FLAGS_input);
  command.seed = absl::GetFlag(FLAGS_seed);
  command.expected_length = absl::GetFlag(FLAGS_expected_length);
  command.head_mask = absl::GetFlag(FLAGS_head_mask).values;
  command.stats = absl::GetFlag(FLAGS_stats);
  command.precision = absl::GetFlag(FLAGS_precision);
  command.save_output = absl::GetFlag(FLAGS_save_output);
  command.save_maps = absl::GetFlag(FLAGS_save_maps);
  command.length = absl::GetFlag(FLAGS_length);
  command.json = absl::GetFlag(FLAGS_json);
  // Flag mistakes first, before any call.
  if (absl::Status status = ValidateSessionCommand(command); !status.ok()) {
    return UsageFail(status);
  }
  NoteNpyConversion(command.input);
  absl::StatusOr<std::string> text = RunSessionCommand(client, command);
  if (!text.ok()) return Fail(text.status());
  std::fputs(text->c_str(), stdout);
  return cli::kExitOk;
}

int RunBenchCommand(const AttentionClient& client) {
  if (absl::GetFlag(FLAGS_decode) && absl::GetFlag(FLAGS_churn)) {
    return RunDecodeChurnCommand(client);
  }
  if (absl::GetFlag(FLAGS_decode)) return RunDecodeBenchCommand(client);
  const AttendOptions options = AttendOptionsFromFlags();
  if (absl::Status status = ValidateAttendOptions(options); !status.ok()) return UsageFail(status);
  BenchOptions bench;
  bench.concurrency = absl::GetFlag(FLAGS_concurrency);
  bench.rate = absl::GetFlag(FLAGS_rate);
  bench.duration_seconds = absl::GetFlag(FLAGS_duration);
  bench.requests = absl::GetFlag(FLAGS_requests);
  if (absl::Status status = ValidateBenchOptions(bench); !status.ok()) return UsageFail(status);
  NoteNpyConversion(options.input);
  NoteNpyConversion(options.mask);
  absl::StatusOr<AttendCall> call = AttendCallFor(client, options);
  if (!call.ok()) return Fail(call.status());
  // A bar redrawn in place on a terminal; a plain line every second otherwise.
  const bool tty = isatty(STDERR_FILENO);
  auto last_line = std::make_shared<int64_t>(-1);
  BenchProgress progress = [&bench, tty, last_line](int64_t finished, double elapsed) {
    const double fraction =
        bench.requests > 0 ? static_cast<double>(finished) / static_cast<double>(bench.requests)
                           : elapsed / bench.duration_seconds;
    const double clamped = std::clamp(fraction, 0.0, 1.0);
    if (tty) {
      std::fprintf(stderr, "\r%s %3.0f%% %lld calls %.1f s", ProgressBar(clamped).c_str(),
                   100 * clamped, static_cast<long long>(finished), elapsed);
    } else if (static_cast<int64_t>(elapsed) > *last_line) {
      *last_line = static_cast<int64_t>(elapsed);
      std::fprintf(stderr, "bench: %.0f%% %lld calls %.0f s\n", 100 * clamped,
                   static_cast<long long>(finished), elapsed);
    }
  };
  absl::StatusOr<BenchResult> result = RunBench(client, call->request, bench, progress);
  if (tty) std::fprintf(stderr, "\n");
  if (!result.ok()) return Fail(result.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", FormatBenchJson(*result).c_str());
  } else {
    std::printf("%s", FormatBenchText(*result).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace attnserve::client

int main(int argc, char** argv) {
  namespace cli = attnserve::cli;
  using attnserve::client::kUsage;
  const absl::StatusOr<cli::CommandLine> command_line = cli::ParseCommandLine(argc, argv);
  if (!command_line.ok()) return cli::UsageError("attnctl", command_line.status().message());
  const bool help_command =
      command_line->positional.size() == 1 && command_line->positional[0] == "help";
  if (command_line->action == cli::CommandLine::Action::kHelp || help_command) {
    std::fputs(cli::HelpText(absl::StrCat("attnctl: ", kUsage)).c_str(), stdout);
    return cli::kExitOk;
  }
  if (command_line->action == cli::CommandLine::Action::kVersion) {
    const cli::Component grpc_version = {"gRPC", grpc::Version()};
    std::fputs(cli::VersionText("attnctl", {&grpc_version, 1}).c_str(), stdout);
    return cli::kExitOk;
  }
  if (command_line->positional.empty()) {
    return cli::UsageError("attnctl", "no command (models, model, load, unload, attend, health, "
                                      "bench, session)");
  }
  const std::string& command = command_line->positional[0];
  // session takes a verb: session open|extend|get|fork|truncate|close.
  const size_t words = command == "session" ? 2 : 1;
  if (command == "session" && command_line->positional.size() < 2) {
    return cli::UsageError("attnctl", absl::StrCat("session: which? (",
                                                   absl::StrJoin(attnserve::client::kSessionVerbs,
                                                                 ", "),
                                                   ")"));
  }
  if (command_line->positional.size() > words) {
    return cli::UsageError("attnctl", absl::StrCat("unexpected argument '",
                                                   command_line->positional[words],
                                                   "' (one command, then flags)"));
  }
  using Runner = int (*)(const attnserve::client::AttentionClient&);
  const std::pair<const char*, Runner> commands[] = {
      {"models", attnserve::client::RunModels}, {"model", attnserve::client::RunModel},
      {"load", attnserve::client::RunLoad},     {"unload", attnserve::client::RunUnload},
      {"attend", attnserve::client::RunAttend}, {"health", attnserve::client::RunHealth},
      {"bench", attnserve::client::RunBenchCommand}};
  Runner run = nullptr;
  for (const auto& [name, runner] : commands) {
    if (command == name) run = runner;
  }
  if (run == nullptr && command != "session") {
    return cli::UsageError("attnctl", absl::StrCat("unknown command '", command,
                                                   "' (models, model, load, unload, attend, "
                                                   "health, bench, session)"));
  }

  attnserve::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.lb_policy = absl::GetFlag(FLAGS_lb_policy);
  options.health_check_service = absl::GetFlag(FLAGS_lb_health_check_service);
  options.retry.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout_seconds);
  options.max_receive_message_bytes = absl::GetFlag(FLAGS_max_receive_message_bytes);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.tls.enabled = !options.tls.ca_file.empty() || !options.tls.cert_file.empty();
  options.routing_key = absl::GetFlag(FLAGS_routing_key);
  if (const std::string token_file = absl::GetFlag(FLAGS_token_file); !token_file.empty()) {
    absl::StatusOr<std::string> token = attnserve::cli::ReadFileBytes(token_file);
    if (!token.ok()) return attnserve::client::Fail(token.status());
    const std::string first_line = token->substr(0, token->find('\n'));
    options.bearer_token = std::string(absl::StripAsciiWhitespace(first_line));
    if (options.bearer_token.empty()) {
      return attnserve::client::Fail(
          absl::InvalidArgumentError(absl::StrCat("--token_file: no token in ", token_file)));
    }
  }
  // Every Create error is about a flag's value (target, policy, limits, TLS
  // files): a command line that cannot work.
  auto client = attnserve::client::AttentionClient::Create(options);
  if (!client.ok()) return attnserve::client::UsageFail(client.status());
  if (command == "session") {
    return attnserve::client::RunSessionCommandLine(**client, command_line->positional[1]);
  }
  return run(**client);
}
