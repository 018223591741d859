"""How vLLM is asked to write a target's hidden states: the one definition of its configs.

Used by remote/extract.py for the offline engine and, loaded from this file (stdlib only), by
the laptop's specops.service_spec for `inv serve --extract`: both ask for the same thing.
"""


def vllm_configs(layers: list[int], storage: str, cpu: bool) -> dict:
    """The speculative + kv-transfer configs (engine argument names) that make vLLM write the states
    of ``layers`` (vLLM's ids: the aux ids + the last layer) to ``storage``, one file per request."""
    connector = ({"kv_connector": "CpuHiddenStatesConnector",  # the stock connector needs CUDA
                  "kv_connector_module_path": "cpu_hidden_states_connector"}
                 if cpu else {"kv_connector": "ExampleHiddenStatesConnector"})
    return {
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}},
        "kv_transfer_config": {**connector, "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": storage}},
    }
