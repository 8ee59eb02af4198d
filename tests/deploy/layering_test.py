#!/usr/bin/python3
"""The folders depend on each other in one direction only, include by include:
every `#include "..."` in core/, cli/, client/ and server/ (each of server/'s
sub-folders on its own) names a folder its folder may depend on. The libraries
enforce the same direction at link time (each links only the parts below it);
this names the file and line that broke it, header-only uses included.

    core/                  core/ only (no gRPC, protobuf or Prometheus)
    cli/                   cli/ only
    client/                client/, the proto, cli/ (never core/)
    server/common/         itself, core (the options name core's choices)
    server/scheduling/     itself, common, core (no gRPC, protobuf or Prometheus)
    server/models/         itself, common, core (no gRPC, protobuf or Prometheus)
    server/observability/  itself, common, core, the proto, cli/
    server/security/       itself, common, core
    server/api/            itself, the four parts above, common, core, the proto
    server/http/           itself, security, common, core, the proto (calls the
                           gRPC services through a channel, never api/)
    server/explorer/       itself, http, security, common, core, the proto, cli/ (the
                           attention explorer's routes on the HTTP port; calls
                           the gRPC services through a channel, never api/)
    server/ (top)          all of server/, core, the proto, cli/

No folder outside tests/ includes tests/. A new folder under server/ needs a
rule here before it may include anything of ours.

Usage: layering_test.py --repo REPO
"""
import argparse
import os
import re
import sys
import tempfile
import unittest

ARGS = None

# Folders whose C++ sources are checked.
CHECKED_ROOTS = ("core", "cli", "client", "server")
SOURCE_SUFFIXES = (".h", ".cc")

# What each folder's #include "..." may name. "proto" is the generated public
# API ("attnserve/v1/...", "grpc/health/v1/...", "inference/..." for the Open
# Inference Protocol).
SERVER_PARTS = ("server/scheduling", "server/models", "server/observability", "server/security")
ALLOWED = {
    "core": {"core"},
    "cli": {"cli"},
    "client": {"client", "proto", "cli"},
    "server/common": {"server/common", "core"},
    "server/scheduling": {"server/scheduling", "server/common", "core"},
    "server/models": {"server/models", "server/common", "core"},
    "server/observability": {"server/observability", "server/common", "core", "proto", "cli"},
    "server/security": {"server/security", "server/common", "core"},
    "server/sessions": {"server/sessions", "server/models", "server/common", "core"},
    # The decode sessions sit on the models (a session holds its layers' models).
    "server/api": {"server/api", *SERVER_PARTS, "server/sessions", "server/common", "core", "proto"},
    "server/http": {"server/http", "server/security", "server/common", "core", "proto"},
    "server/explorer": {"server/explorer", "server/http", "server/security", "server/common", "core",
                        "proto", "cli"},
    "server": {"server", "server/api", "server/http", "server/explorer", *SERVER_PARTS, "server/sessions", "server/common", "core",
               "proto", "cli"},
}
# Folders that must build without gRPC, protobuf and Prometheus: their
# libraries do not link them, and their tests run without them (ThreadSanitizer
# runs the scheduling and model tests).
NO_RPC = {"core", "server/scheduling", "server/models", "server/common", "server/sessions"}
RPC_HEADERS = ("grpcpp/", "grpc/", "google/protobuf/", "prometheus/")

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def folder_of_path(path):
    """The layering folder of a repository path ("server/api/x.h" ->
    "server/api", "server/attn_server.h" -> "server", "core/kernels/y.h" ->
    "core"), or None when the path is outside the checked folders."""
    parts = path.split("/")
    root = parts[0]
    if root == "server":
        return "/".join(parts[:2]) if len(parts) > 2 else "server"
    if root in CHECKED_ROOTS:
        return root
    if root == "tests":
        return "tests"
    return None


def folder_of_include(name):
    """The folder a quoted include names, or None for a library outside the
    repository (Abseil, oneDNN, ...)."""
    if name.startswith(("attnserve/", "grpc/health/", "inference/")):
        return "proto"
    return folder_of_path(name)


def check_tree(repo):
    """(violations, files checked, includes checked): violations are
    "path:line: message" strings."""
    violations, files, includes = [], 0, 0
    for root in CHECKED_ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(repo, root)):
            dirnames.sort()
            for filename in sorted(filenames):
                if not filename.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.relpath(os.path.join(dirpath, filename), repo)
                files += 1
                checked, found = check_file(repo, path)
                includes += checked
                violations += found
    return violations, files, includes


def check_file(repo, path):
    """(includes checked, violations) of one source file."""
    folder = folder_of_path(path)
    allowed = ALLOWED.get(folder)
    violations, checked = [], 0
    with open(os.path.join(repo, path), encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            m = INCLUDE.match(line)
            if not m:
                continue
            bracket, name = m.groups()
            where = f"{path}:{number}"
            if folder in NO_RPC and name.startswith(RPC_HEADERS):
                violations.append(f"{where}: {folder}/ must build without gRPC, protobuf and "
                                  f"Prometheus, but includes {bracket}{name}")
                continue
            if bracket != '"':
                continue
            target = folder_of_include(name)
            if target is None:
                continue
            checked += 1
            if allowed is None:
                violations.append(f"{where}: {folder}/ has no layering rule "
                                  f"(tests/deploy/layering_test.py, ALLOWED), but includes \"{name}\"")
            elif target not in allowed:
                violations.append(f"{where}: {folder}/ may not depend on {target}/, but includes "
                                  f"\"{name}\" (it may include {', '.join(sorted(allowed))})")
    return checked, violations


class RepositoryIncludes(unittest.TestCase):
    def test_every_include_points_down_the_layers(self):
        violations, files, includes = check_tree(ARGS.repo)
        if violations:
            self.fail(f"{len(violations)} include(s) against the layering:\n" + "\n".join(violations))
        # Not vacuous: the folders were there and had includes of ours.
        self.assertGreater(files, 50, "too few sources found: is --repo the repository?")
        self.assertGreater(includes, 200)

    def test_every_server_folder_has_a_rule(self):
        server = os.path.join(ARGS.repo, "server")
        folders = sorted(d for d in os.listdir(server) if os.path.isdir(os.path.join(server, d)))
        self.assertIn("api", folders)
        for d in folders:
            self.assertIn(f"server/{d}", ALLOWED, f"server/{d}/ has no layering rule")


class EachRuleCatchesItsMistake(unittest.TestCase):
    """The checker on a small tree of its own: each wrong include is named with
    its file and line, and the right ones pass."""

    def violations(self, files):
        with tempfile.TemporaryDirectory(prefix="attnserve-layering-") as repo:
            for path, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(repo, path)), exist_ok=True)
                with open(os.path.join(repo, path), "w") as f:
                    f.write(text)
            return check_tree(repo)[0]

    def assertFinds(self, path, include, message):
        text = f'#include <vector>\n\n#include "absl/status/status.h"\n{include}\n'
        found = self.violations({path: text})
        self.assertEqual(len(found), 1, found)
        self.assertTrue(found[0].startswith(f"{path}:4: "), found[0])
        self.assertIn(message, found[0])

    def test_the_allowed_directions_pass(self):
        self.assertEqual(self.violations({
            "core/kernels/a.cc": '#include "core/head_config.h"\n#include "absl/status/status.h"\n'
                                 '#include "oneapi/dnnl/dnnl.hpp"\n',
            "client/b.cc": '#include "attnserve/v1/attention.grpc.pb.h"\n#include "cli/build_info.h"\n'
                           '#include <grpcpp/grpcpp.h>\n',
            "server/models/c.cc": '#include "server/common/message_text.h"\n#include "core/x.h"\n',
            "server/observability/d.cc": '#include "attnserve/v1/attention.pb.h"\n'
                                         '#include "cli/build_info.h"\n#include <prometheus/gauge.h>\n',
            "server/api/e.cc": '#include "server/models/model_registry.h"\n'
                               '#include "server/scheduling/scheduler.h"\n'
                               '#include "server/security/auth.h"\n',
            "server/f.cc": '#include "server/api/attention_service.h"\n#include "cli/command_line.h"\n',
            "server/api/g.cc": '// #include "server/attn_server.h" in a comment is no include\n',
        }), [])

    def test_core_includes_only_core(self):
        self.assertFinds("core/a.cc", '#include "server/api/status_util.h"', "core/ may not depend on server/api/")
        self.assertFinds("core/kernels/a.cc", '#include "client/attention_client.h"', "core/ may not depend on client/")
        self.assertFinds("core/a.h", "#include <grpcpp/grpcpp.h>", "core/ must build without gRPC")

    def test_client_and_cli(self):
        self.assertFinds("client/a.cc", '#include "core/head_config.h"', "client/ may not depend on core/")
        self.assertFinds("cli/a.cc", '#include "client/attention_client.h"', "cli/ may not depend on client/")
        self.assertFinds("cli/a.cc", '#include "attnserve/v1/attention.pb.h"', "cli/ may not depend on proto/")

    def test_no_part_includes_the_api_or_the_top(self):
        for part in SERVER_PARTS + ("server/common",):
            self.assertFinds(f"{part}/a.cc", '#include "server/api/status_util.h"',
                             f"{part}/ may not depend on server/api/")
            self.assertFinds(f"{part}/a.cc", '#include "server/attn_server.h"',
                             f"{part}/ may not depend on server/")
        self.assertFinds("server/api/a.cc", '#include "server/attn_server.h"',
                         "server/api/ may not depend on server/")

    def test_the_parts_do_not_include_each_other(self):
        for part in SERVER_PARTS:
            for other in SERVER_PARTS:
                if other != part:
                    self.assertFinds(f"{part}/a.cc", f'#include "{other}/x.h"',
                                     f"{part}/ may not depend on {other}/")
        self.assertFinds("server/common/a.h", '#include "server/models/x.h"',
                         "server/common/ may not depend on server/models/")

    def test_scheduling_and_models_stay_without_rpc(self):
        self.assertFinds("server/scheduling/a.cc", '#include "attnserve/v1/attention.pb.h"',
                         "server/scheduling/ may not depend on proto/")
        self.assertFinds("server/models/a.h", "#include <grpcpp/support/status.h>",
                         "server/models/ must build without gRPC")
        self.assertFinds("server/scheduling/a.cc", "#include <google/protobuf/message.h>",
                         "server/scheduling/ must build without gRPC")

    def test_nothing_includes_tests(self):
        self.assertFinds("server/api/a.cc", '#include "tests/core/reference_attention.h"',
                         "server/api/ may not depend on tests/")

    def test_a_new_server_folder_needs_a_rule(self):
        self.assertFinds("server/brand_new/a.cc", '#include "core/head_config.h"',
                         "server/brand_new/ has no layering rule")

    def test_sessions_stay_below_the_service(self):
        self.assertFinds("server/sessions/a.cc", '#include "server/api/attend_plan.h"',
                         "server/sessions/ may not depend on server/api/")
        self.assertFinds("server/sessions/a.h", "#include <grpcpp/support/status.h>",
                         "server/sessions/ must build without gRPC")


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
