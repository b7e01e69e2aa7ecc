"""Starting ScienceWorld's JVM with a capped heap so that several run side by side."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

DEFAULT_JVM_OPTIONS = "-Xmx512m -XX:+UseSerialGC"


@contextlib.contextmanager
def capped_jvm_options(options: str = DEFAULT_JVM_OPTIONS) -> Iterator[None]:
    """Sets ``JAVA_TOOL_OPTIONS`` while the package launches its JVM, then restores the old value.

    The package's ``launch_gateway`` call takes no JVM options, but every JVM reads this variable.
    """
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = options
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = previous
