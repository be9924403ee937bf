"""A connector that moves nothing, for `pd.py bench --connectors null`:
what vLLM's KV-connector machinery costs a prefill call by itself, so
that a transport's own cost can be told from vLLM's. Loaded with
`kv_connector="NullConnector"`, `kv_connector_module_path="null_connector"`
(ci/vllm on the workers' PYTHONPATH).

It frees a finished request's blocks at once (`request_finished` returns
`(False, params)`), so no decode can read them: the prefill role only."""

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullMetadata(KVConnectorMetadata):
    pass


class NullConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Optional[Any] = None):
        super().__init__(vllm_config, role, kv_cache_config)

    # Worker side: nothing to load or save.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # Scheduler side: no external hits; blocks freed when the request ends.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullMetadata()

    def request_finished(self, request: Any, block_ids: Any):
        return False, {"null": True}
