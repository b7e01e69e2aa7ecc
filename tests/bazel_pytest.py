"""Entry point of the Bazel py_test targets: runs pytest on the test files given as arguments."""

import os
import sys

import pytest

if __name__ == "__main__":
    # Bazel runs tests from the runfiles tree; make the workspace root importable and the working directory.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(root)
    sys.path.insert(0, root)
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
