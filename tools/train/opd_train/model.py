"""The student: a transformers causal LM with a peft LoRA adapter, and one micro-batch's loss + backward.

The LM head runs over the response positions only, in chunks of ``--logit-chunk`` rows: the
decoder's hidden states are detached, each chunk's logits -> loss -> backward accumulates into
the detached copy's gradient, and one final backward carries that gradient through the decoder.
So the [positions x vocab] logits (and their fp32 upcast) of a whole micro-batch never exist at
once, and the result is the same as one big backward (losses are sums over tokens / num_tokens).
"""

from __future__ import annotations

import contextlib

from opd_common.models import load_causal_lm, pick_dtype, use_gqa_attention

from . import losses
from .data import Example, collate


class Student:
    def __init__(self, config, device: str, lm=None):
        """Load --model (or take `lm`, a model already on `device`: benchmarks) and add the LoRA adapter."""
        import torch
        from peft import LoraConfig, get_peft_model

        self.config = config
        self.device = device
        if lm is None:
            lm = load_causal_lm(config.model, config.revision, pick_dtype(config.dtype, device, config.model), device)
        use_gqa_attention(lm)
        targets = "all-linear" if config.lora_targets == "all-linear" else [t.strip() for t in config.lora_targets.split(",")]
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")
        torch.manual_seed(config.seed)
        try:
            self.peft = get_peft_model(lm, lora)
        except ValueError as exc:
            from opd_common.errors import ConfigError

            raise ConfigError(f"--lora-targets {config.lora_targets}: {str(exc).splitlines()[0]}") from None
        base = self.peft.get_base_model()
        if config.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.peft.train()
        self.decoder = base.get_decoder()
        self.bucket = 1
        if getattr(config, "compile", False):
            self.decoder = torch.compile(self.decoder)
            self.bucket = 128
        self.head = base.get_output_embeddings()
        # bf16 base weights: run the fp32 LoRA weights' matmuls in bf16 too (mixed precision, fp32 master
        # weights and optimizer state); without it peft upcasts every projection's input to fp32.
        low = next(base.parameters()).dtype == torch.bfloat16 and str(device).startswith("cuda")
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if low else contextlib.nullcontext
        self.params = [p for p in self.peft.parameters() if p.requires_grad]

    def hidden(self, batch: dict):
        """Decoder hidden states at the positions that predict response tokens: [N, H]."""
        ids = batch["ids_BL"].to(self.device)
        with self.autocast():
            h_BLH = self.decoder(input_ids=ids).last_hidden_state
        return h_BLH[batch["rows_N"].to(self.device), batch["cols_N"].to(self.device)]

    @contextlib.contextmanager
    def base_weights(self):
        """The initial student: the base model with the adapter disabled, no gradients."""
        import torch

        with self.peft.disable_adapter(), torch.no_grad():
            yield

    def reference_logprobs(self, batch: dict):
        """log p_ref(y_t) of the base weights at the sampled tokens (for the k3 KL): [N]."""
        with self.base_weights():
            h = self.hidden(batch)
            targets = batch["targets_N"].to(self.device)
            chunk = self.config.logit_chunk
            with self.autocast():
                parts = [losses.token_logprobs(self.head(h[s:s + chunk]), targets[s:s + chunk]) for s in range(0, h.shape[0], chunk)]
        import torch

        return torch.cat(parts)

    def micro_step(self, examples: list[Example], num_tokens: int, beta: float) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate. Returns summed metric contributions."""
        import torch

        cfg = self.config
        batch = collate(examples, bucket=self.bucket)
        dev = {k: v.to(self.device) for k, v in batch.items() if k not in ("ids_BL",)}
        extra = {}
        if cfg.loss == "shift" or (cfg.loss in ("grpo", "dapo") and cfg.kl_coef):
            extra["ref_logp"] = self.reference_logprobs(batch)
        if cfg.loss == "fkl" and cfg.self_teacher:
            with self.base_weights():
                extra["teacher_h"] = self.hidden(collate(examples, context="teacher", bucket=self.bucket))
        h_NH = self.hidden(batch)
        h_detached = h_NH.detach().requires_grad_()
        totals: dict[str, float] = {"loss": 0.0}
        n = h_NH.shape[0]
        for start in range(0, n, cfg.logit_chunk):
            sl = slice(start, min(start + cfg.logit_chunk, n))
            with self.autocast():
                logits = self.head(h_detached[sl])
            out = self._loss(logits, {k: v[sl] for k, v in dev.items()}, {k: v[sl] for k, v in extra.items()},
                             num_tokens, beta)
            out.loss.backward()
            totals["loss"] += float(out.loss.detach())
            for key, value in out.metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            del logits, out
        h_NH.backward(h_detached.grad)
        return totals

    def _loss(self, logits_NV, tok: dict, extra: dict, num_tokens: int, beta: float):
        cfg = self.config
        if cfg.loss == "sft":
            return losses.sft(logits_NV, tok["targets_N"], num_tokens)
        if cfg.loss == "rkl":
            return losses.rkl(logits_NV, tok["targets_N"], tok["behaviour_logp"], tok["advantage"], num_tokens,
                              ratio_clip=cfg.ratio_clip, teacher_logp_N=tok["teacher_logp"])
        if cfg.loss in ("grpo", "dapo"):
            return losses.ppo_clip(logits_NV, tok["targets_N"], tok["behaviour_logp"], tok["advantage"], num_tokens,
                                   clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                   ref_logp_N=extra.get("ref_logp"), kl_coef=cfg.kl_coef)
        if cfg.loss == "fkl" and cfg.self_teacher:
            with self.base_weights(), self.autocast():
                teacher_logits = self.head(extra["teacher_h"])
            return losses.fkl_full(logits_NV, teacher_logits, num_tokens, temperature=cfg.loss_temperature, clip=cfg.kl_clip)
        if cfg.loss == "fkl":
            return losses.fkl(logits_NV, tok["ids"], tok["teacher_logp"], num_tokens, temperature=cfg.loss_temperature,
                              clip=cfg.kl_clip, tail=cfg.fkl_tail)
        return losses.shift(logits_NV, tok["ids"], tok["delta"], tok["targets_N"], extra["ref_logp"], num_tokens, beta=beta)
