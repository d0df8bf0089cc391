"""vLLM connector subclasses that move KV bytes wrongly, for testing the KV
audit (``kv_audit``). Each is vLLM's own ``ExampleConnector`` (it stores every
new prompt's KV in a directory and loads it back on an external hit) with one
bug put back. Configure one as ``kv_connector`` with
``kv_connector_module_path="kvtrace.lab.fault_connectors"``.

``DropsResumedLoad`` ("resumed-load-dropped", the shape of LMCache issue
    #2007): ``update_state_after_alloc`` for a request resumed after a
    preemption is dropped. The scheduler has counted the external hit as
    computed; nothing loads it; the request reads whatever its new blocks
    held. Every count agrees with a correct run.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class DropsResumedLoad(ExampleConnector):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if getattr(request, "num_preemptions", 0) > 0:
            return   # the bug: a resumed request's load is dropped
        return super().update_state_after_alloc(request, blocks, num_external_tokens)


def corrupt_stored_prompt(connector: Any, prompt: list[int], block: int = 1) -> str:
    """Change one byte of block ``block`` of ``prompt``'s stored KV, in the first
    layer's file of ``connector``'s (an ExampleConnector's) store; returns the
    file. The storage layer's corruption: the next load of that prompt copies
    bytes that differ from those saved."""
    import os

    import safetensors.torch
    import torch

    bs = connector._block_size
    aligned = (len(prompt) - 1) // bs * bs
    folder = connector._generate_foldername_debug(torch.tensor(prompt)[:aligned], [],
                                                  create_folder=False)
    name = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    path = os.path.join(folder, name)
    tensors = safetensors.torch.load_file(path)
    kv = tensors["kv_cache"]
    flat = kv[block * bs].view(-1).view(torch.uint8)
    flat[0] ^= 0x40
    safetensors.torch.save_file(tensors, path)
    return path
