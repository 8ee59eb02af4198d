#include "client/attend_report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "cli/npy.h"
#include "client/attention_client.h"
#include "client/bench.h"
#include "client/heatmap.h"
#include "client/png.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace attnserve::client {

using ::attnserve::cli::WriteNpyFile;

namespace {

// Sequences shown one by one in the statistics table; more are averaged.
constexpr int64_t kMaxStatTables = 4;

// "FP32", "BF16", ...: the enum value's name in the proto, without its prefix.
std::string DataTypeText(v1::DataType dtype) {
  const std::string& name = v1::DataType_Name(dtype);
  return name.empty() ? "?" : std::string(absl::StripPrefix(name, "DATA_TYPE_"));
}

std::string TensorText(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "] ", DataTypeText(tensor.dtype()));
}

std::vector<int64_t> ShapeOf(const v1::Tensor& tensor) {
  return std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end());
}

// "5, 3, 8" -- or "8 each" when all are equal.
std::string LengthsText(const std::vector<int64_t>& lengths) {
  if (!lengths.empty() &&
      std::all_of(lengths.begin(), lengths.end(), [&](int64_t l) { return l == lengths[0]; })) {
    return absl::StrCat(lengths[0], " each");
  }
  return absl::StrJoin(lengths, ", ");
}

std::string LayerText(const AttendCall& call, const v1::AttendResponse& response) {
  const v1::HeadConfig& c = call.config;
  std::string shape = absl::StrCat("d_model ", c.d_model(), ", heads ", c.num_heads(),
                                   ", kv heads ", c.num_kv_heads(), ", head_dim ", c.head_dim());
  if (c.rotary().rotary_dim() > 0) {
    absl::StrAppend(&shape, ", rotary_dim ", c.rotary().rotary_dim(), " (theta ",
                    c.rotary().theta(), ")");
  }
  if (call.request.has_layer()) {
    return absl::StrCat("ad-hoc layer (seed ", call.request.layer().seed(), "): ", shape);
  }
  return absl::StrCat("model ", response.model().empty() ? call.request.model() : response.model(),
                      ": ", shape);
}

}  // namespace

absl::StatusOr<std::string> FormatMapSummary(const AttendCall& call, const v1::Tensor& maps) {
  absl::StatusOr<std::vector<float>> values = TensorValues(maps);
  if (!values.ok()) return values.status();
  const auto& shape = maps.shape();
  if (shape.size() != 3 && shape.size() != 4) {
    return absl::InvalidArgumentError(absl::StrCat("maps: unexpected rank ", shape.size()));
  }
  const bool per_head = shape.size() == 4;
  const int64_t batch = shape[0];
  const int64_t maps_per_seq = per_head ? shape[1] : 1;
  const int64_t seq_q = shape[shape.size() - 2];
  const int64_t seq_kv = shape[shape.size() - 1];
  const auto& rows = call.request.attention_maps().query_rows();
  const auto& heads = call.request.attention_maps().heads();
  std::string text = absl::StrFormat(
      "attention maps [%s] %s: row sums per %s (min .. max over the real query rows)\n",
      absl::StrJoin(shape, ", "), DataTypeText(maps.dtype()), per_head ? "head" : "map");
  for (int64_t h = 0; h < maps_per_seq; ++h) {
    double lo = INFINITY, hi = -INFINITY, max_weight = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t length =
          b < static_cast<int64_t>(call.query_lengths.size()) ? call.query_lengths[b] : seq_q;
      for (int64_t i = 0; i < seq_q; ++i) {
        const int64_t position = rows.empty() ? i : rows[i];
        if (position >= length) continue;  // padding: a row of zeros
        const float* row = values->data() + ((b * maps_per_seq + h) * seq_q + i) * seq_kv;
        double sum = 0;
        for (int64_t j = 0; j < seq_kv; ++j) {
          sum += row[j];
          max_weight = std::max<double>(max_weight, row[j]);
        }
        lo = std::min(lo, sum);
        hi = std::max(hi, sum);
      }
    }
    const std::string label =
        per_head ? absl::StrFormat("head %2d", heads.empty() ? h : heads[h]) : "mean   ";
    if (lo > hi) {
      absl::StrAppendFormat(&text, "  %s: (no real query rows)\n", label);
    } else {
      absl::StrAppendFormat(&text, "  %s: %.7f .. %.7f   largest weight %.4f\n", label, lo, hi,
                            max_weight);
    }
  }
  return text;
}

absl::StatusOr<std::string> FormatHeadStatistics(const AttendCall& call,
                                                 const v1::HeadStatistics& stats) {
  absl::StatusOr<std::vector<float>> entropy = TensorValues(stats.entropy());
  if (!entropy.ok()) return entropy.status();
  absl::StatusOr<std::vector<float>> max_weight = TensorValues(stats.max_weight());
  if (!max_weight.ok()) return max_weight.status();
  if (stats.entropy().shape_size() != 2) {
    return absl::InvalidArgumentError("head_statistics.entropy: expected [batch, num_heads]");
  }
  const int64_t batch = stats.entropy().shape(0), heads = stats.entropy().shape(1);
  // Contribution is absent for projected requests.
  std::vector<float> contribution;
  if (stats.has_contribution() && stats.contribution().shape_size() > 0) {
    absl::StatusOr<std::vector<float>> values = TensorValues(stats.contribution());
    if (!values.ok()) return values.status();
    contribution = *std::move(values);
  }
  const size_t expected = static_cast<size_t>(batch * heads);
  if (max_weight->size() != expected ||
      (!contribution.empty() && contribution.size() != expected)) {
    return absl::InvalidArgumentError("head_statistics: the tensors' shapes differ");
  }

  std::string text;
  auto table = [&](absl::string_view title, auto value_of) {
    absl::StrAppend(&text, title, "\n    head   entropy (nats)   max weight   contribution\n");
    for (int64_t h = 0; h < heads; ++h) {
      const auto [e, m, c] = value_of(h);
      absl::StrAppendFormat(&text, "    %4d   %14.4f   %10.4f   %12s\n", h, e, m,
                            contribution.empty() ? "-" : absl::StrFormat("%.4f", c));
    }
  };
  const bool per_sequence = batch <= kMaxStatTables;
  for (int64_t b = 0; per_sequence && b < batch; ++b) {
    const int64_t keys =
        b < static_cast<int64_t>(call.key_lengths.size()) ? call.key_lengths[b] : 0;
    const int64_t queries =
        b < static_cast<int64_t>(call.query_lengths.size()) ? call.query_lengths[b] : 0;
    std::string title = absl::StrCat("head statistics, sequence ", b);
    if (queries > 0 && keys > 0) {
      absl::StrAppendFormat(&title,
                            " (%d queries x %d keys; uniform weights: entropy ln %d = %.4f)",
                            queries, keys, keys, std::log(static_cast<double>(keys)));
    }
    table(title, [&](int64_t h) {
      const size_t i = static_cast<size_t>(b * heads + h);
      return std::tuple<double, double, double>{(*entropy)[i], (*max_weight)[i],
                                                contribution.empty() ? 0.0 : contribution[i]};
    });
  }
  if (!per_sequence) {
    table(absl::StrCat("head statistics, mean over the ", batch, " sequences"), [&](int64_t h) {
      double e = 0, m = 0, c = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const size_t i = static_cast<size_t>(b * heads + h);
        e += (*entropy)[i];
        m += (*max_weight)[i];
        if (!contribution.empty()) c += contribution[i];
      }
      return std::tuple<double, double, double>{e / batch, m / batch, c / batch};
    });
  }
  return text;
}

std::string FormatAttendSummary(const AttendCall& call, const v1::AttendResponse& response) {
  const v1::AttendRequest& request = call.request;
  std::string text = absl::StrCat(LayerText(call, response), "\n");
  absl::StrAppend(&text, "kernel ", response.kernel_path().empty() ? "?" : response.kernel_path());
  const std::string asked = PrecisionText(request.precision());
  const std::string ran = PrecisionText(response.precision());
  if (response.precision() == v1::PRECISION_UNSPECIFIED) {
    absl::StrAppend(&text, ", precision not reported (asked ", asked, ")\n");
  } else if (ran != asked) {
    absl::StrAppend(&text, ", precision ", ran, " (asked ", asked,
                    "; the server's CPU has no native ", asked, ")\n");
  } else {
    absl::StrAppend(&text, ", precision ", ran, "\n");
  }

  if (request.has_projected()) {
    absl::StrAppend(&text, "input  projected q ", TensorText(request.projected().q()), ", k ",
                    TensorText(request.projected().k()), ", v ",
                    TensorText(request.projected().v()), ", ", call.input_source, "\n");
  } else {
    absl::StrAppend(&text, "input  ", call.packed ? "packed " : "",
                    TensorText(request.hidden_states()), ", ", call.input_source, "\n");
  }
  const bool ragged =
      call.packed || request.sequence_lengths_size() > 0 || request.context_lengths_size() > 0;
  if (ragged) {
    absl::StrAppend(&text, "       sequence lengths ", LengthsText(call.query_lengths), "\n");
  }
  if (request.has_context()) {
    absl::StrAppend(&text, "       context ", call.packed ? "packed " : "",
                    TensorText(request.context()), ", random (cross-attention)\n");
  }
  if (call.cross_attention && ragged) {
    absl::StrAppend(&text, "       context lengths ", LengthsText(call.key_lengths), "\n");
  }
  std::vector<std::string> options;
  if (request.causal()) options.push_back("causal");
  if (request.has_mask()) {
    options.push_back(absl::StrCat(
        request.mask().kind() == v1::AttentionMask::KIND_ADDITIVE ? "additive" : "allowed",
        " mask ", TensorText(request.mask().values())));
  }
  if (request.head_mask_size() > 0) {
    options.push_back(absl::StrCat("head_mask ", absl::StrJoin(request.head_mask(), ",")));
  }
  if (request.position_offsets_size() > 0) {
    options.push_back(
        absl::StrCat("position offsets ", absl::StrJoin(request.position_offsets(), ",")));
  }
  if (!options.empty()) absl::StrAppend(&text, "       ", absl::StrJoin(options, "; "), "\n");

  absl::StrAppend(&text, "output ", TensorText(response.output()), "\n");
  absl::StatusOr<std::vector<float>> output = TensorValues(response.output());
  if (!output.ok()) {
    absl::StrAppend(&text, "output: cannot decode: ", output.status().message(), "\n");
  } else if (!output->empty()) {
    // The first real token's first values (row 0 of sequence 0 is never padding).
    const size_t n = std::min<size_t>(6, output->size());
    absl::StrAppend(&text, "output first values:");
    for (size_t j = 0; j < n; ++j) absl::StrAppendFormat(&text, " %+.5f", (*output)[j]);
    absl::StrAppend(&text, "\n");
  }
  if (response.has_attention_maps()) {
    absl::StatusOr<std::string> maps = FormatMapSummary(call, response.attention_maps());
    absl::StrAppend(
        &text,
        maps.ok() ? *maps : absl::StrCat("maps: cannot decode: ", maps.status().message(), "\n"));
  }
  if (request.attention_maps().head_statistics()) {
    if (!response.has_head_statistics()) {
      absl::StrAppend(&text, "head statistics: not in the response\n");
    } else {
      absl::StatusOr<std::string> stats = FormatHeadStatistics(call, response.head_statistics());
      absl::StrAppend(&text, stats.ok() ? *stats
                                        : absl::StrCat("head statistics: cannot decode: ",
                                                       stats.status().message(), "\n"));
    }
  }
  return text;
}

absl::StatusOr<std::string> JsonLine(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("JSON of ", message.GetTypeName(), ": ",
                                            status.ToString()));
  }
  return json;
}

namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;

void SetNumber(Struct& s, const std::string& key, double number) {
  (*s.mutable_fields())[key].set_number_value(number);
}

void SetString(Struct& s, const std::string& key, const std::string& text) {
  (*s.mutable_fields())[key].set_string_value(text);
}

Struct& SetStruct(Struct& s, const std::string& key) {
  return *(*s.mutable_fields())[key].mutable_struct_value();
}

// {"dtype": "DATA_TYPE_FP32", "shape": [2, 8, 768]}
void SetTensorShape(Struct& s, const std::string& key, const v1::Tensor& tensor) {
  Struct& t = SetStruct(s, key);
  SetString(t, "dtype", v1::DataType_Name(tensor.dtype()));
  ListValue* shape = (*t.mutable_fields())["shape"].mutable_list_value();
  for (int64_t d : tensor.shape()) shape->add_values()->set_number_value(static_cast<double>(d));
}

// A [batch, num_heads] statistic as nested lists; its dtype and shape when
// it cannot be decoded.
void SetStatistic(Struct& s, const std::string& key, const v1::Tensor& tensor) {
  absl::StatusOr<std::vector<float>> values = TensorValues(tensor);
  if (!values.ok() || tensor.shape_size() != 2) {
    SetTensorShape(s, key, tensor);
    return;
  }
  ListValue* rows = (*s.mutable_fields())[key].mutable_list_value();
  const int64_t heads = tensor.shape(1);
  for (int64_t b = 0; b < tensor.shape(0); ++b) {
    ListValue* row = rows->add_values()->mutable_list_value();
    for (int64_t h = 0; h < heads; ++h) row->add_values()->set_number_value((*values)[b * heads + h]);
  }
}

}  // namespace

double DurationMillis(const google::protobuf::Duration& d) {
  return static_cast<double>(d.seconds()) * 1e3 + static_cast<double>(d.nanos()) * 1e-6;
}

std::string DurationText(const google::protobuf::Duration& d) {
  return absl::FormatDuration(absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos()));
}

absl::StatusOr<std::string> FormatAttendJson(const AttendCall& call,
                                             const v1::AttendResponse& response,
                                             const std::vector<double>& latencies_ms,
                                             const std::vector<double>& transports_ms,
                                             const std::vector<std::string>& files) {
  Struct json;
  SetString(json, "model", response.model());
  SetString(json, "kernel_path", response.kernel_path());
  SetString(json, "precision", v1::Precision_Name(response.precision()));
  SetString(json, "input_source", call.input_source);
  SetTensorShape(json, "output", response.output());
  if (response.has_attention_maps()) {
    SetTensorShape(json, "attention_maps", response.attention_maps());
  }
  if (response.has_head_statistics()) {
    Struct& stats = SetStruct(json, "head_statistics");
    SetStatistic(stats, "entropy", response.head_statistics().entropy());
    SetStatistic(stats, "max_weight", response.head_statistics().max_weight());
    if (response.head_statistics().has_contribution()) {
      SetStatistic(stats, "contribution", response.head_statistics().contribution());
    }
  }
  Struct& server = SetStruct(json, "server");
  SetNumber(server, "queue_ms", DurationMillis(response.timing().queue()));
  SetNumber(server, "compute_ms", DurationMillis(response.timing().compute()));
  SetNumber(server, "batch_size", response.timing().batch_size());
  SetNumber(server, "batch_tokens", static_cast<double>(response.timing().batch_tokens()));
  SetNumber(json, "calls", static_cast<double>(latencies_ms.size()));
  Struct& latency = SetStruct(json, "latency_ms");
  double sum = 0;
  for (double ms : latencies_ms) sum += ms;
  SetNumber(latency, "p50", Percentile(latencies_ms, 50));
  SetNumber(latency, "p90", Percentile(latencies_ms, 90));
  SetNumber(latency, "p99", Percentile(latencies_ms, 99));
  SetNumber(latency, "max", latencies_ms.empty() ? 0 : latencies_ms.back());
  SetNumber(latency, "mean",
            latencies_ms.empty() ? 0 : sum / static_cast<double>(latencies_ms.size()));
  Struct& transport = SetStruct(json, "transport_ms");
  double transport_sum = 0;
  for (double ms : transports_ms) transport_sum += ms;
  SetNumber(transport, "p50", Percentile(transports_ms, 50));
  SetNumber(transport, "mean", transports_ms.empty()
                                   ? 0
                                   : transport_sum / static_cast<double>(transports_ms.size()));
  ListValue* written = (*json.mutable_fields())["files"].mutable_list_value();
  for (const std::string& line : files) written->add_values()->set_string_value(line);
  return JsonLine(json);
}

absl::StatusOr<std::vector<std::string>> SaveAttendFiles(const AttendOptions& options,
                                                         const AttendCall& call,
                                                         const v1::AttendResponse& response) {
  std::vector<std::string> written;
  if (!options.save_output.empty()) {
    absl::StatusOr<std::vector<float>> output = TensorValues(response.output());
    if (!output.ok()) return output.status();
    const std::vector<int64_t> shape = ShapeOf(response.output());
    if (absl::Status s = WriteNpyFile(options.save_output, shape, *output); !s.ok()) return s;
    written.push_back(absl::StrCat("wrote ", options.save_output, " (output [",
                                   absl::StrJoin(shape, ", "), "] <f4)"));
  }
  if (options.save_maps.empty() && options.maps_png.empty()) return written;
  if (!response.has_attention_maps()) {
    return absl::FailedPreconditionError("the response has no attention maps to save");
  }
  absl::StatusOr<std::vector<float>> maps = TensorValues(response.attention_maps());
  if (!maps.ok()) return maps.status();
  const std::vector<int64_t> shape = ShapeOf(response.attention_maps());
  if (!options.save_maps.empty()) {
    if (absl::Status s = WriteNpyFile(options.save_maps, shape, *maps); !s.ok()) return s;
    written.push_back(absl::StrCat("wrote ", options.save_maps, " (maps [",
                                   absl::StrJoin(shape, ", "), "] <f4)"));
  }
  if (!options.maps_png.empty()) {
    const v1::AttentionMapRequest& asked = call.request.attention_maps();
    MapsPictureOptions picture;
    picture.sequence = options.png_sequence;
    picture.heads.assign(asked.heads().begin(), asked.heads().end());
    picture.query_rows.assign(asked.query_rows().begin(), asked.query_rows().end());
    if (options.png_sequence < static_cast<int64_t>(call.query_lengths.size())) {
      picture.query_length = call.query_lengths[options.png_sequence];
      picture.key_length = call.key_lengths[options.png_sequence];
    }
    absl::StatusOr<HeatmapSpec> spec = HeatmapFromMaps(*maps, shape, picture);
    if (!spec.ok()) return spec.status();
    const std::string what =
        call.request.has_layer() ? "AD-HOC LAYER" : absl::StrCat("MODEL ", call.request.model());
    spec->title = absl::StrCat(spec->title, " - ", what, call.request.causal() ? ", CAUSAL" : "",
                               call.cross_attention ? ", CROSS-ATTENTION" : "");
    absl::StatusOr<RenderedHeatmap> picture_out = RenderHeatmap(*spec);
    if (!picture_out.ok()) return picture_out.status();
    if (absl::Status s = WritePngFile(options.maps_png, picture_out->image); !s.ok()) return s;
    written.push_back(absl::StrCat("wrote ", options.maps_png, " (", picture_out->image.width(),
                                   " x ", picture_out->image.height(), " heatmap of sequence ",
                                   options.png_sequence, ", ", spec->tiles.size(), " tile",
                                   spec->tiles.size() == 1 ? "" : "s", ", scale 0 .. ",
                                   absl::StrFormat("%.3g", picture_out->layout.scale_max), ")"));
  }
  return written;
}

}  // namespace attnserve::client
