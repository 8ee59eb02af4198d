#!/usr/bin/python3
"""The attnserve Python package installed as the README says, then tested.

Creates a virtual environment with Debian's Python and --system-site-packages
(grpcio, protobuf and numpy come from Debian's packages) in a temporary
folder, pip-installs client/python into it offline (--no-index
--no-build-isolation: nothing is downloaded and nothing runs protoc), checks
that the installed files are the package's, and runs package_test.py with the
environment's interpreter against the real attnserve binary (--installed:
the package must come from the environment, not the checkout).

The package is built from a copy of client/python, so that the build's
scratch (build/, *.egg-info) never lands in the checkout while other tests
read it.

Usage: install_test.py --server PATH/attnserve --repo REPO [package_test arguments...]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def run(argv, **kwargs):
    print("install_test: " + " ".join(argv), flush=True)
    return subprocess.run(argv, check=True, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--repo", required=True)
    args, rest = parser.parse_known_args()
    package = os.path.join(args.repo, "client", "python")
    with tempfile.TemporaryDirectory(prefix="attnserve-venv-") as tmp:
        source = os.path.join(tmp, "python")
        shutil.copytree(package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        venv = os.path.join(tmp, "v")
        run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv])
        python = os.path.join(venv, "bin", "python")
        # No pip configuration of the machine's or user's (files or PIP_*
        # variables, e.g. extra wheel folders) may give pip another source.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        run([os.path.join(venv, "bin", "pip"), "install", "--no-index", "--no-build-isolation", source], env=env)
        listed = subprocess.run([os.path.join(venv, "bin", "pip"), "show", "--files", "attnserve"], env=env,
                                check=True, capture_output=True, text=True).stdout
        for f in ["attnserve/__init__.py", "attnserve/aio.py", "attnserve/v1/attention_pb2.py",
                  "attnserve/v1/attention_pb2.pyi", "attnserve/v1/attention_pb2_grpc.py", "attnserve/py.typed"]:
            if f not in listed:
                sys.exit(f"install_test: the installed package lacks {f}:\n{listed}")
        test = os.path.join(os.path.dirname(os.path.abspath(__file__)), "package_test.py")
        # Run from the temporary folder: the checkout's client/python must not be importable.
        done = subprocess.run([python, test, "--server", args.server, "--installed", *rest], cwd=tmp, env=env)
        sys.exit(done.returncode)


if __name__ == "__main__":
    main()
