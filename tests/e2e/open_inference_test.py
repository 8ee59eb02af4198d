"""The Open Inference Protocol (KServe v2) gRPC service of the real attnserve
binary, called through Python stubs generated at test time from our
proto/inference/open_inference.proto (Debian's protoc and
grpc_python_plugin), against attnserve.v1's Attend on the same server.

The server runs without dynamic batching (--max_batch_tokens=0), so the same
request computes the same bits on either API: every ModelInfer output is
compared bit for bit (the raw bytes) with Attend's for the same fresh random
inputs -- raw and typed contents, FP32 and BF16 in, BF16 compute and output,
ragged sequence_lengths, causal, masks, head masks, cross-attention context,
attention maps (per head and mean) and head statistics named in `outputs`.
Attend's side is built with the attnserve package (client/python), not with
our translation. Also: health and metadata RPCs, ModelMetadata's schema
against GetModel, the refusals (code and field named), token auth, the
ModelInfer metrics series (present from start-up) and access log line.

  open_inference_test.py --server <attnserve> --proto_dir <repo>/proto
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--server", required=True)
PARSER.add_argument("--proto_dir", required=True)
ARGS, UNITTEST_ARGS = PARSER.parse_known_args()

D_MODEL, NUM_HEADS = 768, 12  # the built-in model
TOKEN = "oip-test-token-5b1e"
oip = None  # the generated inference.open_inference_pb2
oip_grpc = None


def generate_oip_stubs(out_dir):
    """Our proto's modules, as the globals oip and oip_grpc."""
    global oip, oip_grpc
    oip, oip_grpc = harness.generate_open_inference_stubs(out_dir, ARGS.proto_dir)


# --- Requests on both APIs from the same arrays ---

def add_input(request, name, array, datatype, raw):
    """Appends `array` as input `name` of `datatype` ("FP32", "BF16", "INT32",
    "INT64", "BOOL"), its values raw or in the typed field."""
    array = np.asarray(array)
    tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
    if datatype == "BF16":
        from attnserve import tensors
        data = tensors.to_bf16_words(array)
    else:
        data = np.ascontiguousarray(array, dtype={"FP32": "<f4", "INT32": "<i4", "INT64": "<i8",
                                                   "BOOL": "u1"}[datatype])
    if raw:
        request.raw_input_contents.append(data.tobytes())
        return
    flat = data.ravel().tolist()
    if datatype == "FP32":
        tensor.contents.fp32_contents.extend(flat)
    elif datatype == "INT32":
        tensor.contents.int_contents.extend(flat)
    elif datatype == "INT64":
        tensor.contents.int64_contents.extend(flat)
    elif datatype == "BOOL":
        tensor.contents.bool_contents.extend(bool(v) for v in flat)
    else:
        raise ValueError(f"{datatype} has no typed contents")


def infer_request(x, *, raw=True, input_dtype=None, lengths=None, lengths_type="INT64", causal=None,
                  context=None, context_lengths=None, mask=None, mask_kind=None, head_mask=None,
                  head_mask_type="FP32", maps=None, heads=None, rows=None, precision=None,
                  output_dtype=None, outputs=None, model="default"):
    """A ModelInferRequest for the same inputs as Client.attend's arguments."""
    states_type = "BF16" if input_dtype == "bf16" else "FP32"
    r = oip.ModelInferRequest(model_name=model, id="e2e")
    add_input(r, "hidden_states", x, states_type, raw)
    if lengths is not None:
        add_input(r, "sequence_lengths", lengths, lengths_type, raw)
    if context is not None:
        add_input(r, "context", context, states_type, raw)
    if context_lengths is not None:
        add_input(r, "context_lengths", context_lengths, lengths_type, raw)
    if mask is not None:
        mask = np.asarray(mask)
        add_input(r, "mask", mask, "BOOL" if mask.dtype == np.bool_ else "FP32", raw)
    if head_mask is not None:
        add_input(r, "head_mask", np.asarray(head_mask) != 0 if head_mask_type == "BOOL" else head_mask,
                  head_mask_type, raw)
    if heads is not None:
        add_input(r, "attention_map_heads", heads, "INT32", raw)
    if rows is not None:
        add_input(r, "attention_map_rows", rows, "INT64", raw)
    if causal is not None:
        r.parameters["causal"].bool_param = causal
    if mask_kind is not None:
        r.parameters["mask_kind"].string_param = mask_kind
    if maps is not None:
        r.parameters["attention_maps"].string_param = maps
    if precision is not None:
        r.parameters["precision"].string_param = precision
    if output_dtype is not None:
        r.parameters["output_dtype"].string_param = output_dtype.upper()
    for name in outputs or []:
        r.outputs.add(name=name)
    return r


def v1_bytes(tensor):
    """(datatype, shape, bytes) of an attnserve.v1 Tensor as Attend sent it."""
    from attnserve.v1 import attention_pb2 as pb
    datatype = {pb.DATA_TYPE_FP32: "FP32", pb.DATA_TYPE_BF16: "BF16"}[tensor.dtype or pb.DATA_TYPE_FP32]
    data = tensor.raw_data if tensor.raw_data else np.asarray(tensor.float_data, dtype="<f4").tobytes()
    return datatype, list(tensor.shape), data


def oip_bytes(response, name):
    """(datatype, shape, bytes, raw?) of output `name` of a ModelInferResponse."""
    names = [o.name for o in response.outputs]
    assert name in names, f"{name} not in the response's outputs {names}"
    i = names.index(name)
    out = response.outputs[i]
    if response.raw_output_contents:
        return out.datatype, list(out.shape), response.raw_output_contents[i], True
    return out.datatype, list(out.shape), np.asarray(out.contents.fp32_contents, dtype="<f4").tobytes(), False


V1_FIELDS = {
    "output": lambda r: r.output,
    "attention_maps": lambda r: r.attention_maps,
    "head_entropy": lambda r: r.head_statistics.entropy,
    "head_max_weight": lambda r: r.head_statistics.max_weight,
    "head_contribution": lambda r: r.head_statistics.contribution,
}


class ServerCase(unittest.TestCase):
    FLAGS = ()

    @classmethod
    def setUpClass(cls):
        cls.server = harness.Server(ARGS.server, "--max_batch_tokens=0", "--lame_duck_seconds=0", *cls.FLAGS)
        cls.server.wait_serving()
        cls.channel = grpc.insecure_channel(cls.server.target, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        cls.stub = oip_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.stop()

    def assert_refused(self, call, code, *substrings):
        with self.assertRaises(grpc.RpcError) as caught:
            call()
        self.assertEqual(caught.exception.code(), code, caught.exception.details())
        for s in substrings:
            self.assertIn(s, caught.exception.details())
        return caught.exception.details()


class ModelInferMatchesAttend(ServerCase):
    FLAGS = ("--access_log",)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        from attnserve import Client
        cls.client = Client(cls.server.target)
        cls.rng = np.random.default_rng()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        super().tearDownClass()

    def states(self, batch, seq, width=D_MODEL):
        return self.rng.standard_normal((batch, seq, width)).astype(np.float32)

    def check_same(self, x, outputs=("output",), raw=True, lengths_type="INT64", head_mask_type="FP32",
                   **kwargs):
        """ModelInfer and Attend on the same inputs: every named output's
        datatype, shape and bytes equal. Returns the ModelInfer response."""
        from attnserve import messages
        named = list(outputs)
        oip_kwargs = {k: v for k, v in kwargs.items() if k not in ("stats",)}
        stats = any(n.startswith("head_") for n in named)
        maps = kwargs.get("maps")
        if "attention_maps" in named and maps is None:
            maps = "per_head"  # what naming the output alone asks for
        v1_request = messages.build_attend_request(
            x, lengths=kwargs.get("lengths"), causal=bool(kwargs.get("causal")), context=kwargs.get("context"),
            context_lengths=kwargs.get("context_lengths"), mask=kwargs.get("mask"),
            mask_kind=kwargs.get("mask_kind"), head_mask=kwargs.get("head_mask"),
            maps={"per_head": "per-head", "mean": "mean", None: None}[maps], heads=kwargs.get("heads"),
            rows=kwargs.get("rows"), stats=stats, precision=kwargs.get("precision"),
            input_dtype=kwargs.get("input_dtype"), output_dtype=kwargs.get("output_dtype"))
        expected = self.client.stub.Attend(v1_request, timeout=60)
        response = self.stub.ModelInfer(
            infer_request(x, raw=raw, lengths_type=lengths_type, head_mask_type=head_mask_type,
                          outputs=named if outputs != ("output",) else None, **oip_kwargs), timeout=60)
        self.assertEqual([o.name for o in response.outputs], named)
        self.assertEqual(response.model_name, "default")
        self.assertEqual(response.model_version, "1")
        self.assertEqual(response.id, "e2e")
        bf16_out = kwargs.get("output_dtype") == "bf16"
        for name in named:
            want_type, want_shape, want = v1_bytes(V1_FIELDS[name](expected))
            got_type, got_shape, got, got_raw = oip_bytes(response, name)
            self.assertEqual((got_type, got_shape), (want_type, want_shape), name)
            self.assertGreater(len(want), 0, name)
            self.assertTrue(np.array_equal(np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)),
                            f"{name}: ModelInfer's bytes differ from Attend's")
            # Raw iff the request was raw (BF16 values have no typed field).
            self.assertEqual(got_raw, raw or bf16_out, name)
        p = response.parameters
        self.assertEqual(p["kernel_path"].string_param, expected.kernel_path)
        self.assertEqual(p["precision"].string_param,
                         "bf16" if expected.precision == messages.pb.PRECISION_BF16 else "fp32")
        self.assertEqual(p["batch_size"].int64_param, 1)
        return response

    def test_raw_fp32(self):
        self.check_same(self.states(2, 5))

    def test_typed_fp32(self):
        self.check_same(self.states(2, 5), raw=False)

    def test_bf16_hidden_states(self):
        self.check_same(self.states(2, 4), input_dtype="bf16")

    def test_bf16_precision_and_bf16_output_raw_and_typed(self):
        for raw in (True, False):
            with self.subTest(raw=raw):
                r = self.check_same(self.states(1, 6), raw=raw, precision="bf16", output_dtype="bf16")
                self.assertEqual(r.outputs[0].datatype, "BF16")

    def test_ragged_sequence_lengths_int32_and_int64(self):
        for lengths_type, raw in (("INT32", False), ("INT64", True), ("INT32", True)):
            with self.subTest(lengths_type=lengths_type, raw=raw):
                self.check_same(self.states(3, 6), raw=raw, lengths=[6, 2, 4], lengths_type=lengths_type)

    def test_causal(self):
        self.check_same(self.states(2, 7), causal=True)

    def test_bool_and_additive_masks(self):
        allowed = self.rng.random((2, 5, 5)) < 0.7
        allowed[:, :, 0] = True  # every query row keeps a key
        self.check_same(self.states(2, 5), mask=allowed)
        additive = np.where(self.rng.random((1, 5, 5)) < 0.3, -np.inf, self.rng.standard_normal((1, 5, 5)))
        additive[:, :, 0] = 0.0
        self.check_same(self.states(2, 5), raw=False, mask=additive.astype(np.float32))
        # FP32 0/1 values read as allowed (mask_kind), broadcast over query rows.
        allowed_f = (self.rng.random((2, 1, 5)) < 0.5).astype(np.float32)
        allowed_f[:, :, 0] = 1.0
        self.check_same(self.states(2, 5), mask=allowed_f, mask_kind="allowed")

    def test_head_masks_fp32_and_bool(self):
        gates = self.rng.random(NUM_HEADS).astype(np.float32)
        self.check_same(self.states(1, 5), head_mask=gates)
        onoff = (self.rng.random(NUM_HEADS) < 0.5).astype(np.float32)
        onoff[0] = 1.0
        self.check_same(self.states(1, 5), raw=False, head_mask=onoff, head_mask_type="BOOL")

    def test_cross_attention_context_with_lengths(self):
        # The built-in model's context_dim is d_model: any layer takes context.
        for raw in (True, False):
            with self.subTest(raw=raw):
                self.check_same(self.states(2, 4), raw=raw, context=self.states(2, 9), context_lengths=[9, 3])

    def test_attention_maps_per_head_and_mean_named_in_outputs(self):
        self.check_same(self.states(2, 5), outputs=("output", "attention_maps"))
        self.check_same(self.states(2, 5), outputs=("attention_maps", "output"), maps="mean", raw=False)
        r = self.check_same(self.states(1, 6), outputs=("attention_maps",), maps="per_head", heads=[3, 0],
                            rows=[5, 1, 2])
        self.assertEqual(list(r.outputs[0].shape), [1, 2, 3, 6])

    def test_head_statistics_named_in_outputs(self):
        self.check_same(self.states(2, 5), outputs=("head_entropy", "output", "head_max_weight",
                                                    "head_contribution"), raw=False)

    def test_default_outputs_are_output_only(self):
        r = self.stub.ModelInfer(infer_request(self.states(1, 3)), timeout=60)
        self.assertEqual([o.name for o in r.outputs], ["output"])
        self.assertEqual(len(r.raw_output_contents), 1)

    def test_model_infer_is_counted_and_logged_as_itself(self):
        samples = self.server.scrape()
        before = sum(v for (name, labels), v in samples.items()
                     if name == "attnserve_requests_total" and ("method", "ModelInfer") in labels
                     and ("code", "OK") in labels)
        self.stub.ModelInfer(infer_request(self.states(1, 3)), timeout=60)
        with self.assertRaises(grpc.RpcError):
            self.stub.ModelInfer(infer_request(self.states(1, 3, width=7)), timeout=60)
        harness.wait_until("ModelInfer in the access log", lambda: any(
            '"method":"ModelInfer"' in line and '"code":"INVALID_ARGUMENT"' in line for line in list(self.server.log)),
            30)

        def counted():
            samples = self.server.scrape()
            ok = sum(v for (name, labels), v in samples.items()
                     if name == "attnserve_requests_total" and ("method", "ModelInfer") in labels
                     and ("code", "OK") in labels)
            return ok >= before + 1
        harness.wait_until("ModelInfer counted", counted, 30)


class MetricsFromStartUp(ServerCase):
    def test_model_infer_series_exist_before_the_first_call(self):
        samples = self.server.scrape()
        codes = {dict(labels).get("code") for (name, labels) in samples
                 if name == "attnserve_requests_total" and ("method", "ModelInfer") in labels}
        self.assertTrue({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED"} <= codes, codes)

    def test_metadata_series_exist_before_the_first_call(self):
        samples = self.server.scrape()
        expected = {"ModelReady": {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED"},
                    "ModelMetadata": {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE",
                                      "FAILED_PRECONDITION", "UNAUTHENTICATED"},
                    "ServerMetadata": {"OK", "UNAUTHENTICATED"}}
        for method, want in expected.items():
            codes = {dict(labels).get("code") for (name, labels) in samples
                     if name == "attnserve_requests_total" and ("method", method) in labels}
            self.assertEqual(codes, want, method)
        # Durations per model, as GetModel's (ServerMetadata names none).
        for method, model in (("ModelReady", "default"), ("ModelMetadata", "default"),
                              ("ServerMetadata", "")):
            self.assertIn(("attnserve_request_duration_seconds_count",
                           (("code", "OK"), ("method", method), ("model", model))),
                          {(name, tuple(sorted(labels))) for (name, labels) in samples}, method)


class MetadataCallsAreCounted(ServerCase):
    FLAGS = ("--access_log",)

    def test_each_metadata_call_is_counted_and_logged_as_itself(self):
        def count(method, code):
            return sum(v for (name, labels), v in self.server.scrape().items()
                       if name == "attnserve_requests_total" and ("method", method) in labels
                       and ("code", code) in labels)
        before = {(m, c): count(m, c) for m in ("ModelReady", "ModelMetadata", "ServerMetadata")
                  for c in ("OK", "NOT_FOUND")}
        self.assertTrue(self.stub.ModelReady(oip.ModelReadyRequest(name="default"), timeout=10).ready)
        self.stub.ModelMetadata(oip.ModelMetadataRequest(name="default"), timeout=10)
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.ModelMetadata(oip.ModelMetadataRequest(name="no-such-model"), timeout=10)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(self.stub.ServerMetadata(oip.ServerMetadataRequest(), timeout=10).name, "attnserve")
        harness.wait_until("the metadata calls counted", lambda: (
            count("ModelReady", "OK") == before[("ModelReady", "OK")] + 1
            and count("ModelMetadata", "OK") == before[("ModelMetadata", "OK")] + 1
            and count("ModelMetadata", "NOT_FOUND") == before[("ModelMetadata", "NOT_FOUND")] + 1
            and count("ServerMetadata", "OK") == before[("ServerMetadata", "OK")] + 1), 30)
        for method, code in (("ModelReady", "OK"), ("ModelMetadata", "NOT_FOUND"),
                             ("ServerMetadata", "OK")):
            harness.wait_until(f"{method} {code} in the access log", lambda: any(
                f'"method":"{method}"' in line and f'"code":"{code}"' in line
                for line in list(self.server.log)), 30)


class HealthAndMetadata(ServerCase):
    def test_server_live_and_ready(self):
        self.assertTrue(self.stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live)
        self.assertTrue(self.stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready)

    def test_model_ready(self):
        self.assertTrue(self.stub.ModelReady(oip.ModelReadyRequest(name="default"), timeout=10).ready)
        self.assertTrue(self.stub.ModelReady(oip.ModelReadyRequest(name="default", version="1"), timeout=10).ready)
        self.assert_refused(lambda: self.stub.ModelReady(oip.ModelReadyRequest(name="nope"), timeout=10),
                            grpc.StatusCode.NOT_FOUND, "name:", "nope")
        self.assert_refused(lambda: self.stub.ModelReady(oip.ModelReadyRequest(name="default", version="2"),
                                                         timeout=10),
                            grpc.StatusCode.NOT_FOUND, "version:")
        self.assert_refused(lambda: self.stub.ModelReady(oip.ModelReadyRequest(), timeout=10),
                            grpc.StatusCode.INVALID_ARGUMENT, "name: required")

    def test_server_metadata(self):
        r = self.stub.ServerMetadata(oip.ServerMetadataRequest(), timeout=10)
        version = subprocess.run([os.path.join(harness.REPO, "deploy", "version.sh")], capture_output=True,
                                 text=True, check=True).stdout.strip()
        self.assertEqual((r.name, r.version, list(r.extensions)), ("attnserve", version, []))

    def test_model_metadata_schema_against_get_model(self):
        from attnserve import Client
        with Client(self.server.target) as client:
            info = client.stub.GetModel(client_get_model_request("default"), timeout=10)
        m = self.stub.ModelMetadata(oip.ModelMetadataRequest(name="default"), timeout=10)
        h = info.head_config
        self.assertEqual((m.name, list(m.versions), m.platform), ("default", ["1"], "attnserve_attention"))
        inputs = {t.name: (t.datatype, list(t.shape)) for t in m.inputs}
        outputs = {t.name: (t.datatype, list(t.shape)) for t in m.outputs}
        self.assertEqual(inputs, {
            "hidden_states": ("FP32", [-1, -1, h.d_model]), "sequence_lengths": ("INT64", [-1]),
            "context": ("FP32", [-1, -1, h.context_dim or h.d_model]), "context_lengths": ("INT64", [-1]),
            "mask": ("FP32", [-1, -1, -1]), "head_mask": ("FP32", [h.num_heads]),
            "position_offsets": ("INT64", [-1]), "attention_map_heads": ("INT64", [-1]),
            "attention_map_rows": ("INT64", [-1])})
        self.assertEqual(outputs, {
            "output": ("FP32", [-1, -1, h.d_model]), "attention_maps": ("FP32", [-1, -1, -1, -1]),
            "head_entropy": ("FP32", [-1, h.num_heads]), "head_max_weight": ("FP32", [-1, h.num_heads]),
            "head_contribution": ("FP32", [-1, h.num_heads])})
        p = dict(m.properties)
        self.assertEqual((h.d_model, h.num_heads), (D_MODEL, NUM_HEADS))
        for key, want in [("d_model", h.d_model), ("num_heads", h.num_heads), ("num_kv_heads", h.num_kv_heads),
                          ("head_dim", h.head_dim), ("max_batch", info.limits.max_batch),
                          ("max_seq_len", info.limits.max_seq_len)]:
            self.assertEqual(p[key], str(want), key)
        self.assertAlmostEqual(float(p["scale"]), h.scale, places=6)
        self.assertEqual(p["causal"], "true" if info.causal else "false")
        self.assertEqual(p["input_datatypes"], "FP32,BF16")
        self.assert_refused(lambda: self.stub.ModelMetadata(oip.ModelMetadataRequest(name="nope"), timeout=10),
                            grpc.StatusCode.NOT_FOUND, "name:")
        self.assert_refused(
            lambda: self.stub.ModelMetadata(oip.ModelMetadataRequest(name="default", version="v2"), timeout=10),
            grpc.StatusCode.NOT_FOUND, "version:")

    def test_grpc_health_names_the_service(self):
        from health_pb2 import HealthCheckRequest, HealthCheckResponse
        from health_pb2_grpc import HealthStub
        r = HealthStub(self.channel).Check(HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=10)
        self.assertEqual(r.status, HealthCheckResponse.SERVING)


def client_get_model_request(name):
    from attnserve.v1 import attention_pb2 as pb
    return pb.GetModelRequest(name=name)


class BadRequests(ServerCase):
    def good(self, **kwargs):
        x = np.random.default_rng().standard_normal((1, 3, D_MODEL)).astype(np.float32)
        return infer_request(x, **kwargs)

    def refuse(self, request, code, *substrings):
        return self.assert_refused(lambda: self.stub.ModelInfer(request, timeout=30), code, *substrings)

    def test_each_bad_request_names_its_field(self):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        r = self.good()
        r.inputs[0].datatype = "FP64"
        self.refuse(r, invalid, "inputs[0] (hidden_states).datatype", "FP64")
        r = self.good()
        r.inputs[0].shape[:] = [1, 3, D_MODEL, 1]
        self.refuse(r, invalid, "inputs[0] (hidden_states).shape")
        r = self.good()
        r.inputs[0].shape[:] = [1, 4, D_MODEL]  # the bytes are for 3 rows
        self.refuse(r, invalid, "raw_input_contents[0]")
        r = self.good(raw=False)
        r.inputs[0].shape[:] = [1, 4, D_MODEL]
        self.refuse(r, invalid, "inputs[0] (hidden_states).contents.fp32_contents")
        r = self.good()
        r.inputs[0].contents.fp32_contents.extend([1.0])
        self.refuse(r, invalid, "inputs[0] (hidden_states).contents", "raw_input_contents")
        r = self.good(raw=False)
        r.inputs[0].datatype = "BF16"
        self.refuse(r, invalid, "inputs[0] (hidden_states).contents", "BF16")
        r = self.good(head_mask=np.ones(NUM_HEADS, np.float32))
        del r.inputs[0]
        del r.raw_input_contents[0]
        self.refuse(r, invalid, "inputs: hidden_states is required")
        r = self.good(outputs=["output", "logits"])
        self.refuse(r, invalid, "outputs[1].name", "logits")
        r = self.good()
        r.parameters["top_k"].int64_param = 3
        self.refuse(r, invalid, "parameters.top_k: unknown parameter")
        r = self.good()
        r.parameters["causal"].string_param = "yes"
        self.refuse(r, invalid, "parameters.causal: must be a bool_param")
        r = self.good()
        r.parameters["attention_maps"].bool_param = True
        self.refuse(r, invalid, "parameters.attention_maps: must be a string_param")

    def test_attend_validation_with_attends_codes_and_field_names(self):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        # Sizes against the model: PlanAttend's messages, as Attend's.
        x = np.zeros((1, 3, 100), np.float32)
        self.refuse(infer_request(x), invalid, "hidden_states", "d_model")
        self.refuse(self.good(lengths=[9]), invalid, "sequence_lengths")
        self.refuse(self.good(head_mask=np.ones(5, np.float32)), invalid, "head_mask")
        self.refuse(self.good(context_lengths=[2]), invalid, "context_lengths")
        nan = np.zeros((1, 3, D_MODEL), np.float32)
        nan[0, 2, 5] = np.nan
        self.refuse(infer_request(nan), invalid,
                    "hidden_states: sequence 0 holds nan at position 2; inputs must be finite")

    def test_bytes_that_are_not_a_model_infer_request(self):
        call = self.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=lambda b: b, response_deserializer=lambda b: b)
        self.assert_refused(lambda: call(b"\xff\xff\xff\x0f not protobuf", timeout=30),
                            grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid inference.ModelInferRequest")
        self.assertTrue(self.stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live)

    def test_a_long_id_and_a_huge_input_name_get_short_messages(self):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        r = self.good()
        r.id = "i" * 257
        self.refuse(r, invalid, "id: has 257 bytes; at most 256")
        r.id = "i" * 256
        self.assertEqual(self.stub.ModelInfer(r, timeout=30).id, "i" * 256)
        r = self.good()
        r.inputs[0].name = "q" * (1 << 20)
        details = self.refuse(r, invalid, "inputs[0].name: unknown input 'qqq")
        self.assertLess(len(details), 400)

    def test_unknown_model_and_version_are_not_found(self):
        self.refuse(self.good(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "model_name:", "no-such-model")
        r = self.good()
        r.model_version = "3"
        self.refuse(r, grpc.StatusCode.NOT_FOUND, "model_version:")
        r.model_version = "1"
        self.assertEqual(len(self.stub.ModelInfer(r, timeout=30).outputs), 1)


class ManyEmptyEntries(unittest.TestCase):
    def test_millions_of_empty_inputs_are_refused_before_parsing(self):
        # 4 MiB of empty `inputs` entries (2 bytes each on the wire): parsed,
        # each would be an object of ~100 bytes, hundreds of MiB in all. They
        # are counted on the wire form first: INVALID_ARGUMENT naming
        # `inputs`, and the server's peak RSS (VmHWM) barely moves. A server of
        # its own, so that no earlier test's peak hides a jump.
        server = harness.Server(ARGS.server, "--max_batch_tokens=0", "--lame_duck_seconds=0")
        try:
            server.wait_serving()
            with grpc.insecure_channel(server.target, options=[
                    ("grpc.max_send_message_length", 64 << 20)]) as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                           request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
                stub = oip_grpc.GRPCInferenceServiceStub(channel)
                self.assertTrue(stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live)
                before = server.memory_kib()["VmHWM"]
                for tag in (b"\x2a", b"\x32", b"\x3a", b"\x22"):  # inputs, outputs, raw, parameters
                    field = {b"\x2a": "inputs", b"\x32": "outputs", b"\x3a": "raw_input_contents",
                             b"\x22": "parameters"}[tag]
                    with self.assertRaises(grpc.RpcError) as caught:
                        call(b"\x0a\x07default" + (tag + b"\x00") * (2 << 20), timeout=60)
                    self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn(f"{field}: more than", caught.exception.details())
                grown_mib = (server.memory_kib()["VmHWM"] - before) / 1024
                # The 4 MiB requests themselves and gRPC's buffers: well under
                # 64 MiB; parsed, one of them alone would take ~200 MiB.
                self.assertLess(grown_mib, 64, f"peak RSS grew {grown_mib:.0f} MiB")
                # The server answers other calls after.
                x = np.ones((1, 2, D_MODEL), np.float32)
                r = stub.ModelInfer(infer_request(x), timeout=30)
                self.assertEqual(len(r.raw_output_contents[0]), 2 * D_MODEL * 4)
        finally:
            server.stop()


class TokenAuth(unittest.TestCase):
    def test_model_infer_needs_the_token_and_health_does_not(self):
        with tempfile.TemporaryDirectory() as tmp:
            tokens = os.path.join(tmp, "tokens")
            with open(tokens, "w") as f:
                f.write(TOKEN + "\n")
            server = harness.Server(ARGS.server, f"--auth_tokens_file={tokens}", "--max_batch_tokens=0",
                                    "--lame_duck_seconds=0")
            try:
                server.wait_serving()
                with grpc.insecure_channel(server.target) as channel:
                    stub = oip_grpc.GRPCInferenceServiceStub(channel)
                    x = np.ones((1, 2, D_MODEL), np.float32)
                    for call in [lambda md: stub.ModelInfer(infer_request(x), metadata=md, timeout=30),
                                 lambda md: stub.ModelMetadata(oip.ModelMetadataRequest(name="default"),
                                                               metadata=md, timeout=30),
                                 lambda md: stub.ModelReady(oip.ModelReadyRequest(name="default"),
                                                            metadata=md, timeout=30),
                                 lambda md: stub.ServerMetadata(oip.ServerMetadataRequest(), metadata=md,
                                                                timeout=30)]:
                        for md in [(), (("authorization", "Bearer wrong"),)]:
                            with self.assertRaises(grpc.RpcError) as caught:
                                call(md)
                            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                        call((("authorization", f"Bearer {TOKEN}"),))
                    # In plaintext the handler refuses (and counts) them.
                    self.assertEqual(unauthenticated_model_infer_calls(server), 2)
                    assert_probes_open_and_token_serves(self, stub, x)
            finally:
                server.stop()


class ReadinessFollowsTheServersState(unittest.TestCase):
    def test_not_ready_from_the_lame_duck_on_while_still_live_and_serving(self):
        # SIGTERM starts a lame duck: health NOT_SERVING while the server
        # still serves, so balancers move away first. ServerReady and
        # ModelReady turn false with it; ServerLive stays true; calls in the
        # lame duck are still answered.
        server = harness.Server(ARGS.server, "--lame_duck_seconds=60", "--max_batch_tokens=0")
        try:
            server.wait_serving()
            with grpc.insecure_channel(server.target) as channel:
                stub = oip_grpc.GRPCInferenceServiceStub(channel)
                self.assertTrue(stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready)
                self.assertTrue(stub.ModelReady(oip.ModelReadyRequest(name="default"), timeout=10).ready)
                server.proc.send_signal(signal.SIGTERM)
                harness.wait_until("ServerReady false after SIGTERM",
                                   lambda: not stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready, 30)
                self.assertFalse(stub.ModelReady(oip.ModelReadyRequest(name="default"), timeout=10).ready)
                self.assertTrue(stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live)
                x = np.ones((1, 2, D_MODEL), np.float32)
                r = stub.ModelInfer(infer_request(x), timeout=30)
                self.assertEqual(len(r.raw_output_contents[0]), 2 * D_MODEL * 4)
        finally:
            server.stop()


def assert_probes_open_and_token_serves(test, stub, x):
    """ServerLive and ServerReady answer without a token (as grpc.health.v1
    does), and ModelInfer on x [1, 2, d_model] with TOKEN does."""
    test.assertTrue(stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live)
    test.assertTrue(stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready)
    r = stub.ModelInfer(infer_request(x), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
    test.assertEqual(len(r.raw_output_contents[0]), 2 * D_MODEL * 4)


def unauthenticated_model_infer_calls(server):
    """ModelInfer calls the handler answered UNAUTHENTICATED (its metrics)."""
    return sum(v for (name, labels), v in server.scrape().items()
               if name == "attnserve_requests_total" and ("method", "ModelInfer") in labels
               and ("code", "UNAUTHENTICATED") in labels)


class TokenAuthOnTls(unittest.TestCase):
    def test_the_tls_auth_processor_guards_model_infer_and_lets_probes_through(self):
        # On TLS the token is checked from the headers, before the body is
        # read and before the handler: a refused ModelInfer never reaches the
        # handler (its UNAUTHENTICATED counter stays 0, where on plaintext the
        # handler counts it), while ServerLive/ServerReady pass without one.
        with tempfile.TemporaryDirectory() as tmp:
            def openssl(*argv):
                subprocess.run(["openssl", *argv], cwd=tmp, check=True, capture_output=True)
            ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            openssl("req", "-x509", *ec, "-days", "2", "-keyout", "server.key", "-out", "server.pem",
                    "-subj", "/CN=attnserve.test", "-addext", "subjectAltName=DNS:attnserve.test")
            tokens = os.path.join(tmp, "tokens")
            with open(tokens, "w") as f:
                f.write(TOKEN + "\n")
            server = harness.Server(ARGS.server, f"--tls_cert={tmp}/server.pem", f"--tls_key={tmp}/server.key",
                                    f"--auth_tokens_file={tokens}", "--max_batch_tokens=0", "--lame_duck_seconds=0")
            try:
                server.wait_serving()
                with open(os.path.join(tmp, "server.pem"), "rb") as f:
                    creds = grpc.ssl_channel_credentials(root_certificates=f.read())
                with grpc.secure_channel(server.target, creds,
                                         options=[("grpc.ssl_target_name_override", "attnserve.test")]) as channel:
                    stub = oip_grpc.GRPCInferenceServiceStub(channel)
                    x = np.ones((1, 2, D_MODEL), np.float32)
                    with self.assertRaises(grpc.RpcError) as caught:
                        stub.ModelInfer(infer_request(x), timeout=30)
                    self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                    self.assertEqual(unauthenticated_model_infer_calls(server), 0)
                    assert_probes_open_and_token_serves(self, stub, x)
            finally:
                server.stop()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as stubs:
        harness.generate_stubs(stubs, ARGS.proto_dir)
        generate_oip_stubs(stubs)
        unittest.main(module="__main__", argv=[sys.argv[0], "-v", *UNITTEST_ARGS])
