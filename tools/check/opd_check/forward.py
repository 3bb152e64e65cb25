"""Teacher-forced forwards as opd-train computes them (transformers, LoRA unmerged, the run's dtype), and what
an adapter folder holds."""

from __future__ import annotations

import numpy as np


class Forward:
    """A causal LM that returns, for one record, the fp32 logits [T, V] that predict its response tokens."""

    def __init__(self, model: str, revision: str | None, adapter: str | None, dtype: str, device: str,
                 merge: bool = False):
        from opd_common.models import load_causal_lm, pick_device, pick_dtype

        self.device = pick_device(device)
        lm = load_causal_lm(model, revision, pick_dtype(dtype, self.device, model), self.device, adapter)
        self.lm = lm.merge_and_unload() if (adapter and merge) else lm  # a frozen teacher folds its LoRA in
        self.dtype = dtype

    def logits(self, context_ids, response_ids):
        import torch

        ids = np.concatenate([np.asarray(context_ids), np.asarray(response_ids)]).astype(np.int64)
        P, T = len(context_ids), len(response_ids)
        with torch.inference_mode():
            out = self.lm(input_ids=torch.from_numpy(ids)[None].to(self.device), use_cache=False)
        return out.logits[0, P - 1:P - 1 + T].float()

    def close(self) -> None:
        self.lm = None


def unmatched_lora_keys(adapter: str, model: str, revision: str | None) -> tuple[list[str], int, int]:
    """LoRA tensors of the folder that name no module of the model (peft would leave those layers at zero), the
    number of non-zero lora_B tensors, and the number of lora_B tensors. The model is built on the meta device:
    no weights are read."""
    import torch
    from peft import load_peft_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = {k: v.float().numpy() for k, v in load_peft_weights(adapter, device="cpu").items()}
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model, revision=revision))
    names = {name for name, _ in lm.named_modules()}
    unmatched = []
    for key in sorted(weights):
        if ".lora_" not in key:
            continue
        module = key.split(".lora_")[0].removeprefix("base_model.model.")
        if module not in names:
            unmatched.append(key)
    b_keys = [k for k in weights if ".lora_B" in k]
    nonzero = sum(bool(np.any(weights[k])) for k in b_keys)
    return unmatched, nonzero, len(b_keys)
