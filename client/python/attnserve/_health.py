"""The two messages of the standard health service (grpc.health.v1), for
Client.health() and Client.wait_until_serving().

They live in a descriptor pool of their own, described here field by field
(HealthCheckRequest{string service = 1}, HealthCheckResponse{ServingStatus
status = 1}): stubs generated into the default pool would clash with any
other copy of grpc.health.v1 in the same process (grpcio-health-checking's,
or an application's own), which protobuf's C++ runtime refuses. Only the
method paths and field numbers travel on the wire.
"""
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
# HealthCheckResponse.ServingStatus
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _messages():
    f = descriptor_pb2.FileDescriptorProto(name="attnserve/_health.proto", package="grpc.health.v1",
                                           syntax="proto3")
    request = f.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    response = f.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in STATUS_NAMES.items():
        status.value.add(name=name, number=number)
    response.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                       type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
                       label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    classes = []
    for name in ("grpc.health.v1.HealthCheckRequest", "grpc.health.v1.HealthCheckResponse"):
        descriptor = pool.FindMessageTypeByName(name)
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
            classes.append(message_factory.GetMessageClass(descriptor))
        else:
            classes.append(message_factory.MessageFactory(pool).GetPrototype(descriptor))
    return classes


HealthCheckRequest, HealthCheckResponse = _messages()
SERVING = 1  # HealthCheckResponse.ServingStatus


def callables(channel):
    """(Check, Watch) multi-callables of the health service on `channel`
    (grpc's or grpc.aio's)."""
    check = channel.unary_unary(CHECK, request_serializer=HealthCheckRequest.SerializeToString,
                                response_deserializer=HealthCheckResponse.FromString)
    watch = channel.unary_stream(WATCH, request_serializer=HealthCheckRequest.SerializeToString,
                                 response_deserializer=HealthCheckResponse.FromString)
    return check, watch
