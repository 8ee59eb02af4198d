#!/usr/bin/python3
"""deploy/lint_dockerfile.py: the repository's Dockerfile and .dockerignore
pass, and each rule catches the mistake it is there for (the Dockerfile with
one change each, linted against the real build context).

Usage: lint_dockerfile_test.py --repo REPO
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import unittest

ARGS = None


def load_linter():
    path = os.path.join(ARGS.repo, "deploy", "lint_dockerfile.py")
    spec = importlib.util.spec_from_file_location("lint_dockerfile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lint(dockerfile_text=None, dockerignore_text=None):
    """(exit code, output) of the linter on the repository's context with the
    given Dockerfile and .dockerignore texts (None: the repository's own)."""
    with tempfile.TemporaryDirectory(prefix="attnserve-lint-") as work:
        cmd = ["/usr/bin/python3", os.path.join(ARGS.repo, "deploy", "lint_dockerfile.py"),
               "--context", ARGS.repo]
        if dockerfile_text is not None:
            path = os.path.join(work, "Dockerfile")
            with open(path, "w") as f:
                f.write(dockerfile_text)
            cmd += ["--dockerfile", path]
        if dockerignore_text is not None:
            path = os.path.join(work, "dockerignore")
            with open(path, "w") as f:
                f.write(dockerignore_text)
            cmd += ["--dockerignore", path]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return done.returncode, done.stdout + done.stderr


class RepositoryFiles(unittest.TestCase):
    def test_the_dockerfile_and_dockerignore_follow_every_rule(self):
        code, out = lint()
        self.assertEqual(code, 0, out)
        self.assertIn("follow every rule", out)


class EachRuleCatchesItsMistake(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(ARGS.repo, "Dockerfile")) as f:
            cls.dockerfile = f.read()
        with open(os.path.join(ARGS.repo, ".dockerignore")) as f:
            cls.dockerignore = f.read()

    def changed(self, old, new, count=1):
        self.assertIn(old, self.dockerfile)
        return self.dockerfile.replace(old, new, count)

    def assertFinds(self, rule, dockerfile_text=None, dockerignore_text=None, detail=""):
        code, out = lint(dockerfile_text, dockerignore_text)
        self.assertEqual(code, 1, out)
        self.assertRegex(out, rf": {re.escape(rule)}: .*{re.escape(detail)}")

    def drop_instruction(self, keyword):
        """The Dockerfile without its (possibly continued) `keyword` instructions."""
        lines, out, skipping = self.dockerfile.splitlines(), [], False
        for line in lines:
            if line.startswith(keyword + " "):
                skipping = True
            if not skipping:
                out.append(line)
            if skipping and not line.rstrip().endswith("\\"):
                skipping = False
        return "\n".join(out) + "\n"

    def test_from_another_distribution(self):
        self.assertFinds("from-debian-12", self.changed("FROM debian:12 AS build", "FROM ubuntu:22.04 AS build"))
        self.assertFinds("from-debian-12", self.changed("FROM debian:12-slim", "FROM debian:11-slim"))

    def test_from_an_untagged_or_latest_image(self):
        self.assertFinds("no-latest", self.changed("FROM debian:12-slim", "FROM debian"))
        self.assertFinds("no-latest", self.changed("FROM debian:12-slim", "FROM debian:latest"))
        self.assertFinds("no-latest", self.changed("COPY --from=build", "COPY --from=example/tools:latest"))

    def test_add_of_a_url(self):
        # Only linted, never fetched.
        self.assertFinds("no-add-url", self.changed(
            "USER 10001:10001", "ADD https://example.invalid/model.tar.gz /models/\nUSER 10001:10001"))

    def test_final_stage_as_root(self):
        self.assertFinds("final-user", self.drop_instruction("USER"))
        self.assertFinds("final-user", self.changed("USER 10001:10001", "USER root"))
        self.assertFinds("final-user", self.changed("USER 10001:10001", "USER 0:0"))

    def test_no_healthcheck_or_not_attnctl(self):
        self.assertFinds("healthcheck", self.drop_instruction("HEALTHCHECK"))
        self.assertFinds("healthcheck", self.drop_instruction("HEALTHCHECK") + "HEALTHCHECK NONE\n")
        self.assertFinds("healthcheck", self.changed('"health", "--target=127.0.0.1:50051"',
                                                     '"models", "--target=127.0.0.1:50051"'))
        self.assertFinds("healthcheck", self.changed("--target=127.0.0.1:50051", "--target=127.0.0.1:50052"),
                         detail="listens on 50051")

    def test_a_port_not_exposed(self):
        self.assertFinds("expose", self.changed("EXPOSE 50051 9464", "EXPOSE 50051"), detail="metrics port 9464")
        self.assertFinds("expose", self.changed("--metrics_address=0.0.0.0:9464", "--metrics_address=0.0.0.0:9100"),
                         detail="metrics port 9100")
        self.assertFinds("expose", self.changed('CMD ["--listen_address=0.0.0.0:50051"', 'CMD ["--listen_address=:7000"'),
                         detail="gRPC port 7000")

    def test_packages_not_from_the_install_script(self):
        self.assertFinds("install-script", self.changed("COPY deploy/install_deps.sh deploy/\n", ""),
                         detail="no earlier COPY")
        self.assertFinds("install-script", self.changed("/tmp/install_deps.sh --runtime", "/tmp/install_deps.sh"),
                         detail="--runtime")
        self.assertFinds("install-script", self.changed(
            "USER 10001:10001", "RUN apt-get update && apt-get install -y curl\nUSER 10001:10001"))

    def test_copy_of_a_missing_or_ignored_path(self):
        self.assertFinds("context", self.changed("USER 10001:10001", "COPY docs/no-such-file.md /tmp/\nUSER 10001:10001"),
                         detail="does not exist")
        self.assertFinds("context", dockerignore_text=self.dockerignore + "deploy/install_deps.sh\n",
                         detail="deploy/install_deps.sh is excluded")
        # After COPY . ., the build stage runs deploy/build.sh from the context.
        self.assertFinds("context", dockerignore_text=self.dockerignore + "deploy/*.sh\n!deploy/install_deps.sh\n",
                         detail="RUN uses deploy/build.sh")

    def test_a_dockerignore_that_lets_build_trees_or_git_in(self):
        self.assertFinds("context", dockerignore_text="*.log\n", detail="does not exclude .git")
        self.assertFinds("context", dockerignore_text=".git\n", detail="does not exclude build")


class DockerIgnorePatterns(unittest.TestCase):
    """Docker's matching, which differs from .gitignore's."""

    def test_patterns(self):
        ignore = load_linter().DockerIgnore(
            "# comment\nbuild*\n.git\n**/*.log\n**/__pycache__\ndocs\n!docs/keep.md\n/tmp/x?\n")
        for path in ["build", "build/x/y.o", "build-serve/z", "build.configure.log", ".git/HEAD",
                     "a.log", "deploy/x/b.log", "tests/e2e/__pycache__/h.pyc", "docs/measurements.md",
                     "tmp/x1"]:
            self.assertTrue(ignore.excluded(path), path)
        for path in ["deploy/build.sh", "client/build.cc", ".gitignore", "docs/keep.md", "tmp/x12",
                     "Dockerfile"]:
            self.assertFalse(ignore.excluded(path), path)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
