#!/usr/bin/python3
"""Lints the Dockerfile and .dockerignore against the rules attnserve's image
relies on. Debian has no hadolint and CI has no Docker engine, so this reads
the files as Docker would (line continuations, stages, JSON-form commands,
.dockerignore patterns) and checks:

  from-debian-12     every FROM is debian:12* (or an earlier stage)
  no-latest          no image without a tag or tagged latest
  no-add-url         no ADD of a URL (downloads are not reproducible)
  install-script     packages come from deploy/install_deps.sh, COPYed into the
                     stage before the RUN that runs it; the final stage runs it
                     with --runtime; no bare apt-get install
  final-user         the final stage's last USER is not root
  healthcheck        the final stage has a HEALTHCHECK running `attnctl health`
                     on the gRPC port
  expose             the final stage EXPOSEs the gRPC and the metrics port (from
                     CMD's --listen_address/--metrics_address, else the server's
                     defaults in server/common/server_options.h)
  context            every path COPY/ADD takes, and every context file a RUN
                     uses, exists and is not excluded by .dockerignore; the
                     build trees and .git are

Usage: deploy/lint_dockerfile.py [--context DIR] [--dockerfile FILE] [--dockerignore FILE]
Exit status: 0 clean, 1 findings (printed as FILE:LINE: rule: message), 2 usage.
"""
import argparse
import glob
import json
import os
import re
import shlex
import sys

DEBIAN_12 = re.compile(r"^debian:12([.-][A-Za-z0-9._-]*)?(@sha256:[0-9a-f]{64})?$")
URL = re.compile(r"^(https?|ftp|git|ssh)://|^git@")


class Instruction:
    def __init__(self, line, keyword, args):
        self.line = line          # 1-based line of the instruction's first line
        self.keyword = keyword    # upper case
        self.args = args          # the rest, continuations joined

    def json_or_shell(self):
        """The arguments of an exec-form (JSON array) or shell-form command."""
        text = self.args.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    return value
            except ValueError:
                pass
        return shlex.split(text, comments=False, posix=True)


def parse_dockerfile(text):
    """The instructions of a Dockerfile, with '\\' continuations joined and
    comment lines dropped (inside a continuation too, as Docker does)."""
    instructions, parts, start = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#") or (not line.strip() and not parts):
            continue
        if start is None:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        joined = " ".join(p for p in parts if p)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
        parts, start = [], None
    if parts:  # a continuation at the end of the file
        joined = " ".join(p for p in parts if p)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), args.strip()))
    return instructions


def split_flags(words):
    """(--flag=value dict, remaining words) of a COPY/ADD/FROM/HEALTHCHECK."""
    flags, rest = {}, []
    for w in words:
        if not rest and w.startswith("--"):
            name, _, value = w[2:].partition("=")
            flags[name] = value
        else:
            rest.append(w)
    return flags, rest


class DockerIgnore:
    """.dockerignore as Docker reads it: patterns relative to the context root
    ('*' and '?' stay within a path segment, '**' spans segments), a pattern
    also excludes everything under a directory it matches, '!' re-includes,
    the last matching pattern wins."""

    def __init__(self, text):
        self.patterns = []
        for raw in text.splitlines():
            p = raw.strip()
            if not p or p.startswith("#"):
                continue
            negate = p.startswith("!")
            if negate:
                p = p[1:].strip()
            p = os.path.normpath(p).lstrip("/")
            if p == ".":
                continue
            self.patterns.append((negate, re.compile(self._regex(p)), p))

    @staticmethod
    def _regex(pattern):
        out, i = "^", 0
        while i < len(pattern):
            c = pattern[i]
            if pattern.startswith("**/", i):
                out += "(.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif c == "*":
                out += "[^/]*"
                i += 1
            elif c == "?":
                out += "[^/]"
                i += 1
            elif c == "[":
                end = pattern.find("]", i + 1)
                if end < 0:
                    out += re.escape(c)
                    i += 1
                else:
                    cls = pattern[i + 1:end]
                    if cls.startswith("!"):
                        cls = "^" + cls[1:]
                    out += "[" + cls.replace("\\", "\\\\") + "]"
                    i = end + 1
            elif c == "\\" and i + 1 < len(pattern):
                out += re.escape(pattern[i + 1])
                i += 2
            else:
                out += re.escape(c)
                i += 1
        return out + "$"

    def excluded(self, path):
        path = os.path.normpath(path).lstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for negate, regex, _ in self.patterns:
            if any(regex.match(p) for p in prefixes):
                result = not negate
        return result


def address_port(address):
    m = re.search(r":(\d+)$", address or "")
    return int(m.group(1)) if m else None


def server_default_ports(context):
    """(gRPC, metrics) default ports of the attnserve binary, from its options."""
    path = os.path.join(context, "server", "common", "server_options.h")
    try:
        text = open(path).read()
    except OSError:
        return None, None
    grpc = re.search(r'listen_address\s*=\s*"([^"]*)"', text)
    metrics = re.search(r'kDefaultMetricsAddress\[\]\s*=\s*"([^"]*)"', text)
    return (address_port(grpc.group(1)) if grpc else None,
            address_port(metrics.group(1)) if metrics else None)


class Linter:
    def __init__(self, context, dockerfile, dockerignore):
        self.context = context
        self.dockerfile = dockerfile
        self.findings = []
        self.instructions = parse_dockerfile(open(dockerfile).read())
        self.ignore_path = dockerignore
        self.ignore = DockerIgnore(open(dockerignore).read()) if os.path.exists(dockerignore) else None

    def find(self, line, rule, message):
        self.findings.append(f"{os.path.relpath(self.dockerfile)}:{line}: {rule}: {message}")

    def stages(self):
        stages, current = [], None
        for ins in self.instructions:
            if ins.keyword == "FROM":
                current = {"from": ins, "body": [], "name": None}
                stages.append(current)
            elif current is not None:
                current["body"].append(ins)
        return stages

    def run(self):
        stages = self.stages()
        if not stages:
            self.find(1, "from-debian-12", "no FROM")
            return self.findings
        self.check_from(stages)
        self.check_add_and_copy_from(stages)
        self.check_install_script(stages)
        final = stages[-1]
        self.check_user(final)
        grpc_port, metrics_port = self.check_expose(final)
        self.check_healthcheck(final, grpc_port)
        self.check_context(stages)
        return self.findings

    def check_from(self, stages):
        names = set()
        for stage in stages:
            ins = stage["from"]
            _, words = split_flags(ins.args.split())
            if not words:
                self.find(ins.line, "from-debian-12", "FROM without an image")
                continue
            image = words[0]
            if len(words) >= 3 and words[1].upper() == "AS":
                stage["name"] = words[2].lower()
            if image.lower() in names:
                pass  # an earlier stage
            elif ":" not in image.split("/")[-1] and "@" not in image:
                self.find(ins.line, "no-latest", f"image '{image}' has no tag (it means latest)")
            elif re.search(r":latest(@|$)", image):
                self.find(ins.line, "no-latest", f"image '{image}' is tagged latest")
            elif not DEBIAN_12.match(image):
                self.find(ins.line, "from-debian-12", f"image '{image}' is not debian:12*")
            if stage["name"]:
                names.add(stage["name"])

    def check_add_and_copy_from(self, stages):
        names = {s["name"] for s in stages if s["name"]}
        for stage in stages:
            for ins in stage["body"]:
                if ins.keyword not in ("ADD", "COPY"):
                    continue
                flags, words = split_flags(ins.json_or_shell())
                if ins.keyword == "ADD":
                    for src in words[:-1]:
                        if URL.search(src):
                            self.find(ins.line, "no-add-url", f"ADD of the URL {src}")
                source = flags.get("from")
                if source and source.lower() not in names and not source.isdigit():
                    if ":" not in source.split("/")[-1] or source.endswith(":latest"):
                        self.find(ins.line, "no-latest", f"COPY --from={source} without a pinned tag")

    @staticmethod
    def _resolve(workdir, path):
        return os.path.normpath(path if path.startswith("/") else os.path.join(workdir, path))

    def check_install_script(self, stages):
        for index, stage in enumerate(stages):
            workdir, copied, ran = "/", set(), []
            for ins in stage["body"]:
                if ins.keyword == "WORKDIR":
                    workdir = self._resolve(workdir, ins.args.strip())
                elif ins.keyword == "COPY" and "from" not in split_flags(ins.json_or_shell())[0]:
                    _, words = split_flags(ins.json_or_shell())
                    if len(words) < 2:
                        continue
                    dest = words[-1]
                    dest_dir = dest.endswith("/") or len(words) > 2 or dest in (".", "./")
                    for src in words[:-1]:
                        src = os.path.normpath(src)
                        if src == ".":  # the whole context
                            copied.add(self._resolve(self._resolve(workdir, dest), "deploy/install_deps.sh"))
                        elif src == "deploy/install_deps.sh":
                            target = self._resolve(workdir, dest)
                            copied.add(os.path.join(target, "install_deps.sh") if dest_dir else target)
                elif ins.keyword == "RUN":
                    if re.search(r"\bapt-get\s+(-\S+\s+)*install\b|\bapt\s+install\b", ins.args):
                        self.find(ins.line, "install-script",
                                  "apt-get install in a RUN: install through deploy/install_deps.sh")
                    for word in re.split(r"[\s;&|()]+", ins.args):
                        if word.endswith("install_deps.sh"):
                            ran.append((ins, word))
                            if self._resolve(workdir, word) not in copied:
                                self.find(ins.line, "install-script",
                                          f"runs {word}, which no earlier COPY of deploy/install_deps.sh "
                                          "put there in this stage")
            if not ran:
                self.find(stage["from"].line, "install-script",
                          "this stage does not install its packages with deploy/install_deps.sh")
            elif index == len(stages) - 1 and not any("--runtime" in ins.args for ins, _ in ran):
                self.find(ran[0][0].line, "install-script",
                          "the final stage must install only runtime packages (install_deps.sh --runtime)")

    def check_user(self, final):
        users = [ins for ins in final["body"] if ins.keyword == "USER"]
        if not users:
            self.find(final["from"].line, "final-user", "the final stage has no USER: it would run as root")
            return
        user = users[-1].args.strip().split(":")[0]
        if user in ("root", "0", ""):
            self.find(users[-1].line, "final-user", f"USER {users[-1].args.strip()} is root")

    def command_ports(self, final):
        """gRPC and metrics ports the final stage's ENTRYPOINT + CMD serve on."""
        grpc, metrics = server_default_ports(self.context)
        for ins in final["body"]:
            if ins.keyword in ("ENTRYPOINT", "CMD"):
                for word in ins.json_or_shell():
                    if word.startswith("--listen_address="):
                        grpc = address_port(word.partition("=")[2])
                    elif word.startswith("--metrics_address="):
                        metrics = address_port(word.partition("=")[2])
        return grpc, metrics

    def check_expose(self, final):
        grpc, metrics = self.command_ports(final)
        exposed = set()
        for ins in final["body"]:
            if ins.keyword == "EXPOSE":
                for word in ins.args.split():
                    m = re.match(r"^(\d+)(/tcp)?$", word)
                    if m:
                        exposed.add(int(m.group(1)))
        line = final["from"].line
        for what, port in (("gRPC", grpc), ("metrics", metrics)):
            if port is None:
                self.find(line, "expose", f"cannot tell the {what} port (server/common/server_options.h, CMD)")
            elif port not in exposed:
                self.find(line, "expose", f"the {what} port {port} is not EXPOSEd (EXPOSE {sorted(exposed)})")
        return grpc, metrics

    def check_healthcheck(self, final, grpc_port):
        checks = [ins for ins in final["body"] if ins.keyword == "HEALTHCHECK"]
        if not checks:
            self.find(final["from"].line, "healthcheck", "the final stage has no HEALTHCHECK")
            return
        ins = checks[-1]
        m = re.match(r"^((?:--\S+\s+)*)(CMD|NONE)\b\s*(.*)$", ins.args, re.IGNORECASE | re.DOTALL)
        if not m or m.group(2).upper() == "NONE":
            self.find(ins.line, "healthcheck", f"HEALTHCHECK {ins.args} runs no command")
            return
        command = Instruction(ins.line, "CMD", m.group(3)).json_or_shell()
        if not command or not command[0].endswith("attnctl") or "health" not in command[1:]:
            self.find(ins.line, "healthcheck", f"HEALTHCHECK does not run `attnctl health`: {command}")
            return
        target = next((w.partition("=")[2] for w in command if w.startswith("--target=")), "localhost:50051")
        if grpc_port is not None and address_port(target) != grpc_port:
            self.find(ins.line, "healthcheck", f"HEALTHCHECK checks {target}, the server listens on {grpc_port}")

    def check_context(self, stages):
        if self.ignore is None:
            self.find(1, "context", f"no {os.path.relpath(self.ignore_path)}: the whole tree, build "
                      "trees and .git included, would be sent as the build context")
            return
        for needed in (".git", "build"):
            if not self.ignore.excluded(needed):
                self.find(1, "context", f".dockerignore does not exclude {needed}")
        for stage in stages:
            whole_context = False
            for ins in stage["body"]:
                if ins.keyword in ("COPY", "ADD"):
                    flags, words = split_flags(ins.json_or_shell())
                    if "from" in flags:
                        continue
                    for src in words[:-1]:
                        if URL.search(src):
                            continue
                        src = os.path.normpath(src).lstrip("/")
                        if src == ".":
                            whole_context = True
                            continue
                        matches = glob.glob(os.path.join(self.context, src))
                        if not matches:
                            self.find(ins.line, "context", f"{ins.keyword} source {src} does not exist")
                        for m in matches:
                            rel = os.path.relpath(m, self.context)
                            if self.ignore.excluded(rel):
                                self.find(ins.line, "context", f"{ins.keyword} source {rel} is excluded by .dockerignore")
                elif ins.keyword == "RUN" and whole_context:
                    # Context files a RUN uses after COPY . . (e.g. deploy/build.sh).
                    for word in re.split(r"[\s;&|()=\"']+", ins.args):
                        word = word.strip()
                        if not word or word.startswith(("/", "-", "$")):
                            continue
                        if os.path.isfile(os.path.join(self.context, word)) and self.ignore.excluded(word):
                            self.find(ins.line, "context", f"RUN uses {word}, which .dockerignore excludes")


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default=repo)
    parser.add_argument("--dockerfile")
    parser.add_argument("--dockerignore")
    args = parser.parse_args()
    dockerfile = args.dockerfile or os.path.join(args.context, "Dockerfile")
    dockerignore = args.dockerignore or os.path.join(args.context, ".dockerignore")
    findings = Linter(args.context, dockerfile, dockerignore).run()
    for f in findings:
        print(f)
    if findings:
        print(f"lint_dockerfile: {len(findings)} finding(s)", file=sys.stderr)
        return 1
    print(f"lint_dockerfile: {os.path.relpath(dockerfile)} and .dockerignore follow every rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
