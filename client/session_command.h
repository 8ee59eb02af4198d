#ifndef ATTNSERVE_CLIENT_SESSION_COMMAND_H_
#define ATTNSERVE_CLIENT_SESSION_COMMAND_H_

// `attnctl session <verb>`: decode sessions from the shell, one RPC a command
// (extend with random --tokens asks the session and its model first: three).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attnserve::client {

// What `attnctl session <verb>` was asked to do, from its flags.
struct SessionCommand {
  // open, extend, get, latest, fork, truncate or close.
  std::string verb;
  // open: the layers' models, in order (--model, comma-separated).
  std::vector<std::string> models;
  std::string kv_dtype = "fp32";  // open: fp32 or bf16
  int64_t max_tokens = 0;         // open: 0, the server's default
  double ttl_seconds = 0;         // open: 0, the server's default
  int64_t first_position = 0;     // open
  // Every verb but open.
  std::string session_id;
  // extend and latest: the layer (-1: 0); truncate: the layer (-1: every layer).
  int layer = -1;
  // extend: `tokens` random new tokens (normal, seeded by `seed`), or the
  // rows of `input` ([n, d_model] .npy); exactly one of them.
  int64_t tokens = 0;
  std::string input;
  uint64_t seed = 1;
  // extend: the layer's length the step expects (-1: as GetSession says).
  int64_t expected_length = -1;
  std::vector<float> head_mask;     // extend
  bool stats = false;               // extend: the new rows' per-head statistics (--stats)
  std::string precision = "fp32";   // extend: fp32 or bf16
  std::string save_output;          // extend: write the output [n, d_model] as .npy
  int64_t length = -1;              // truncate: tokens to keep (required)
  std::string save_maps;            // latest: write the maps [heads, length] as .npy
  bool json = false;                // print the server's answer as one JSON line
};

// The verbs, in the order the usage lists them.
inline constexpr const char* kSessionVerbs[] = {"open", "extend", "get", "latest",
                                                "fork", "truncate", "close"};

// OK when `command` can be run; else INVALID_ARGUMENT naming the flag (or
// the verb), found before any call: an unknown verb, a missing --session_id,
// --model for open, --tokens and --input both or neither for extend, a
// --length for truncate, a value out of range, a flag the verb does not take
// given a value other than its default. Needs no server. Thread-safe.
absl::Status ValidateSessionCommand(const SessionCommand& command);

// Runs a valid `command` and returns what to print (lines ending in a newline;
// with `json`, the server's answer as one JSON line): open prints the new
// session's id alone on its first line; extend the step's length, the
// output's shape and first values (and the file written with save_output;
// with stats, each head's entropy and max weight of each new row);
// latest what the layer's latest token attends to (per head: entropy, max
// weight and the keys it weighs most; the maps written with save_maps);
// get, fork and truncate the session (fork: the new one); close "closed ID".
// Errors: the calls' statuses as the server gave them; an extend step the
// server refused, with its code and message; the --input or --save_output
// file's errors (naming it). Thread-safe as AttentionClient.
absl::StatusOr<std::string> RunSessionCommand(const AttentionClient& client,
                                              const SessionCommand& command);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_SESSION_COMMAND_H_
