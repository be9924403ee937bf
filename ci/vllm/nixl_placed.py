"""vLLM's NixlConnector (pull) with the worker thread's CPUs given back
after vLLM's NIXL worker narrows them, as kvlane.vllm does: for
`pd.py bench`, so that NIXL and kvlane are compared on the same placement
(the transport, not vLLM's pin, makes the difference). Loaded with
`kv_connector="NixlPlacedConnector"`, `kv_connector_module_path="nixl_placed"`
(ci/vllm on the workers' PYTHONPATH); it uses the real NIXL."""

import os
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector


class NixlPlacedConnector(NixlPullConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Optional[Any] = None):
        before = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        if os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)
