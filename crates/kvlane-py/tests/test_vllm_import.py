"""kvlane.vllm without vLLM installed: a clear ImportError naming what is
needed, and nothing else of kvlane affected. (The connector itself is tested
inside vLLM by ci/vllm.sh.)"""

import importlib.util
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here; ci/vllm.sh tests the connector inside it")
def test_without_vllm_the_import_error_names_it():
    sys.modules.pop("kvlane.vllm", None)
    with pytest.raises(ImportError, match=r"kvlane.vllm needs vLLM 0\.32\.x"):
        importlib.import_module("kvlane.vllm")
    import kvlane.nixl  # noqa: F401  (still fine)

    # kvlane never provides a `nixl` package of its own.
    assert importlib.util.find_spec("nixl") is None or "kvlane" not in (
        importlib.util.find_spec("nixl").origin or "")
