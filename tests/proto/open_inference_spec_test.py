"""Our proto/inference/open_inference.proto against the Open Inference
Protocol's specification, transcribed by hand into
tests/data/open_inference/grpc_fields.txt: the descriptor of the Python code
generated from our proto (Debian's protoc, at test time, into a temporary
folder) has every message, field (number, type, label) and rpc of the list,
and nothing more.

  open_inference_spec_test.py --proto_dir <repo>/proto --fixture <grpc_fields.txt>
"""
import argparse
import os
import sys
import tempfile
import unittest

from google.protobuf import descriptor as d

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from harness import generate_open_inference_stubs  # noqa: E402

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--proto_dir", required=True)
PARSER.add_argument("--fixture", required=True)
ARGS, UNITTEST_ARGS = PARSER.parse_known_args()

SCALARS = {
    d.FieldDescriptor.TYPE_BOOL: "bool", d.FieldDescriptor.TYPE_INT32: "int32",
    d.FieldDescriptor.TYPE_INT64: "int64", d.FieldDescriptor.TYPE_UINT32: "uint32",
    d.FieldDescriptor.TYPE_UINT64: "uint64", d.FieldDescriptor.TYPE_FLOAT: "float",
    d.FieldDescriptor.TYPE_DOUBLE: "double", d.FieldDescriptor.TYPE_STRING: "string",
    d.FieldDescriptor.TYPE_BYTES: "bytes",
}


def read_fixture(path):
    """(package, {field name: (number, type, label)}, {rpc: (request, response)},
    {message names})."""
    package, fields, rpcs, messages = None, {}, {}, set()
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if words[0] == "package":
                package = words[1]
            elif words[0] == "message":
                messages.add(words[1])
            elif words[0] == "rpc":
                rpcs[words[1]] = (words[2], words[3])
            elif words[0] == "field":
                name, number, type_, label = words[1:]
                fields[name] = (int(number), type_, label)
                messages.add(name.rsplit(".", 1)[0])
            else:
                raise ValueError(f"{path}: unknown line {line!r}")
    return package, fields, rpcs, messages


def type_name(field):
    if field.type in (d.FieldDescriptor.TYPE_MESSAGE, d.FieldDescriptor.TYPE_ENUM):
        target = field.message_type or field.enum_type
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (type_name(field.message_type.fields_by_name[n]) for n in ("key", "value"))
            return f"map<{key},{value}>"
        return target.full_name
    return SCALARS[field.type]


def label_of(field):
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "map"
    if field.label == d.FieldDescriptor.LABEL_REPEATED:
        return "repeated"
    oneof = field.containing_oneof
    if oneof is not None:
        # proto3 `optional` is a synthetic oneof named _<field>.
        return "optional" if oneof.name == "_" + field.name else f"oneof:{oneof.name}"
    return "singular"


def differences(ours, spec):
    """What differs between two {name: value} maps, both ways, as sorted lines."""
    out = []
    for name in sorted(set(ours) | set(spec)):
        if ours.get(name) != spec.get(name):
            out.append(f"{name}: ours {ours.get(name)}, specification {spec.get(name)}")
    return out


def walk(message, fields, messages):
    if message.GetOptions().map_entry:
        return
    messages.add(message.full_name)
    for field in message.fields:
        fields[field.full_name] = (field.number, type_name(field), label_of(field))
    for nested in message.nested_types:
        walk(nested, fields, messages)


class ProtoMatchesSpecification(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.spec = read_fixture(ARGS.fixture)
        cls.tmp = tempfile.TemporaryDirectory()
        module, _ = generate_open_inference_stubs(cls.tmp.name, ARGS.proto_dir)
        cls.file = module.DESCRIPTOR
        cls.fields, cls.messages = {}, set()
        for message in cls.file.message_types_by_name.values():
            walk(message, cls.fields, cls.messages)
        cls.rpcs = {}
        for service in cls.file.services_by_name.values():
            for method in service.methods:
                cls.rpcs[method.full_name] = (method.input_type.full_name, method.output_type.full_name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_package_is_the_specifications(self):
        self.assertEqual(self.file.package, self.spec[0])
        self.assertEqual(self.file.syntax, "proto3")

    def test_every_field_is_the_specifications_with_its_number_type_and_label_both_ways(self):
        self.assertGreater(len(self.spec[1]), 50)
        self.assertEqual(differences(self.fields, self.spec[1]), [])

    def test_messages_are_the_same_both_ways(self):
        self.assertEqual(sorted(self.messages ^ self.spec[3]), [])

    def test_rpcs_are_the_same_both_ways(self):
        self.assertEqual(self.rpcs, self.spec[2])
        self.assertEqual(len(self.rpcs), 6)

    def test_the_comparison_sees_a_changed_missing_or_extra_field(self):
        name = "inference.ModelInferRequest.raw_input_contents"
        for number, type_, label in [(8, "bytes", "repeated"), (7, "string", "repeated"),
                                     (7, "bytes", "singular")]:
            spec = {**self.spec[1], name: (number, type_, label)}
            self.assertEqual(len(differences(self.fields, spec)), 1)
        spec = dict(self.spec[1])
        del spec[name]
        self.assertEqual(len(differences(self.fields, spec)), 1)
        spec[name + "_extra"] = (9, "bytes", "repeated")
        self.assertEqual(len(differences(self.fields, spec)), 2)

if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *UNITTEST_ARGS])
