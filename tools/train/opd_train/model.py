"""The student: a transformers causal LM with a peft LoRA adapter, and one micro-batch's loss + backward.

The LM head runs over the response positions only, in chunks of ``--logit-chunk`` rows: the
decoder's hidden states are detached, each chunk's logits -> loss -> backward accumulates into
the detached copy's gradient, and one final backward carries that gradient through the decoder.
So the [positions x vocab] logits (and their fp32 upcast) of a whole micro-batch never exist at
once, and the result is the same as one big backward (losses are sums over tokens / num_tokens).

With --compile, each decoder layer is compiled (compile_decoder) and each chunk's LM head + loss is one
torch.compile'd function (`chunk_loss`), so the loss's vocabulary-wide float32 work (log-softmax, logsumexp,
gathers, their gradients) fuses into a few kernels over the bf16 logits instead of a dozen eager passes; it
computes the same losses (the functions of losses.py, traced), with num_tokens and beta passed as tensors so
that a new step's values do not recompile. For the losses that read the logits only at a few ids per
position (an objective's `compact` in objectives.py: fkl on top-k ids, and sft/rkl/grpo/dapo at the sampled
token) the compiled function first compacts them (`compact_logits`): [N, V] -> [N, K + 1], the K ids' logits
plus one column holding the logsumexp of the rest, which gives the loss the same log-probabilities, tail and
gradient, in one fused pass over the vocabulary forward and one backward (no float32 [N, V] buffers); fkl's
ratio and drift metrics read the sampled token, which is then one more column ([N, K + 2]). Metric
contributions stay on the device (float64, as the eager sums were) until the micro-batch's backward has been
queued: one host sync per micro-batch, not per chunk.
"""

from __future__ import annotations

import contextlib

import torch  # losses imports it too: this module is only imported where a model trains

from opd_common.models import load_causal_lm, pick_dtype, use_gqa_attention

from . import losses
from .data import Example, collate
from .objectives import objective


def compact_logits(logits_NV, ids_NK, temperature: float = 1.0):
    """[N, V] logits -> (C_NB [N, K + 1] float32, ids in C [N, K]) that any loss reading only softmax(logits / tau)
    at ids_NK, the logsumexp over the vocabulary and the one over the vocabulary outside ids_NK sees alike:
    column k (a first occurrence of its id in the row) is logits at ids_NK[:, k], a repeated id's column is
    a floor (exp 0) and its index points to the first occurrence's column, and column K is
    tau * logsumexp(logits / tau outside the ids). Needs K < V. The mask of the rest is one scatter into
    an [N, V] bool; under torch.compile the logsumexp and the gradient are each one fused pass over the
    bf16 logits, and the ids' gradients one scatter-add into the bf16 result.
    """
    K = ids_NK.shape[-1]
    ids_NK = ids_NK.long()
    first_NK = (ids_NK.unsqueeze(-1) == ids_NK.unsqueeze(-2)).int().argmax(-1)  # index of each id's first occurrence
    is_first_NK = first_NK == torch.arange(K, device=ids_NK.device)
    return _Compact.apply(logits_NV, ids_NK, is_first_NK, temperature), first_NK


def _outside(ids_NK, V: int):
    """[N, V] bool: True where the vocabulary id is none of the row's ids_NK (one scatter, not K compares)."""
    return torch.ones(ids_NK.shape[0], V, dtype=torch.bool, device=ids_NK.device).scatter_(-1, ids_NK, False)


class _Compact(torch.autograd.Function):
    """compact_logits' vocabulary-wide part; backward: d/dlogits_v = g_k at a first-occurrence id v = ids[k],
    g_K * softmax(logits / tau)_v over the rest (the derivative of tau * logsumexp(logits / tau))."""

    @staticmethod
    def forward(ctx, logits_NV, ids_NK, is_first_NK, temperature):
        s_NV = logits_NV.float() / temperature
        rest_N = torch.logsumexp(torch.where(_outside(ids_NK, s_NV.shape[-1]), s_NV, float("-inf")), -1)
        floor = torch.finfo(torch.float32).min / 4
        picked_NK = torch.where(is_first_NK, logits_NV.gather(-1, ids_NK).float(), floor)
        ctx.save_for_backward(logits_NV, ids_NK, is_first_NK, rest_N)
        ctx.temperature = temperature
        return torch.cat([picked_NK, (rest_N * temperature).unsqueeze(-1)], -1)

    @staticmethod
    def backward(ctx, g_NB):
        logits_NV, ids_NK, is_first_NK, rest_N = ctx.saved_tensors
        s_NV = logits_NV.float() / ctx.temperature
        outside_NV = _outside(ids_NK, s_NV.shape[-1])
        grad_NV = torch.where(outside_NV, g_NB[:, -1:] * torch.exp(s_NV - rest_N.unsqueeze(-1)), 0.0)
        grad_NV = grad_NV.to(logits_NV.dtype)
        # 0 at the ids, so adding g_k at first occurrences (0 at repeats) sets them exactly.
        g_NK = torch.where(is_first_NK, g_NB[:, :-1], 0.0).to(logits_NV.dtype)
        return grad_NV.scatter_add_(-1, ids_NK, g_NK), None, None, None


def compile_decoder(decoder):
    """--compile's decoder: each of its layers compiled in place (regional compilation: the layers share one code
    object, so one compiled graph per grad mode and batch regime serves all of them, and a new regime compiles one
    layer, not the whole stack), or the whole decoder where it has no `layers` list. In place, so parameter names
    (the adapter's keys) do not change. On a 28-layer model this compiles in a fifth of the time of the whole
    decoder, with the same step time on CPU (docs/benchmarks.md; on a GPU the two are not yet compared on one
    machine)."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return torch.compile(decoder)
    for layer in layers:
        layer.compile()
    return decoder


class Student:
    def __init__(self, config, device: str, lm=None):
        """Load --model (or take `lm`, a model already on `device`: benchmarks) and add the LoRA adapter."""
        import torch
        from peft import LoraConfig, get_peft_model

        self.config = config
        self.objective = objective(config)
        self.device = device
        if lm is None:
            lm = load_causal_lm(config.model, config.revision, pick_dtype(config.dtype, device, config.model), device)
        use_gqa_attention(lm)
        targets = ("all-linear" if config.lora_targets == "all-linear"
                   else [t.strip() for t in config.lora_targets.split(",")])
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
        self.compiled = bool(getattr(config, "compile", False))
        self.chunk_loss = self._chunk_loss
        if self.compiled:
            self.decoder = compile_decoder(self.decoder)
            self.chunk_loss = torch.compile(self._chunk_loss)
            self.bucket = 128
        self.head = base.get_output_embeddings()
        # bf16 base weights: run the fp32 LoRA weights' matmuls in bf16 too (mixed precision, fp32 master
        # weights and optimizer state); without it peft upcasts every projection's input to fp32.
        low = next(base.parameters()).dtype == torch.bfloat16 and str(device).startswith("cuda")
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if low else contextlib.nullcontext
        if low:  # autocast casts each LoRA input back to bf16: skip peft's fp32 copy of it (exact, one pass less)
            for module in self.peft.modules():
                if hasattr(module, "lora_A"):
                    module.cast_input_dtype_enabled = False
        self.params = [p for p in self.peft.parameters() if p.requires_grad]

    def hidden(self, batch: dict):
        """Decoder hidden states at the positions that predict response tokens: [N, H]."""
        ids = batch["ids_BL"].to(self.device)
        if self.compiled:  # a whole compiled decoder: batch and length symbolic from the first call (no
            # static-then-dynamic recompile); compiled layers see them symbolic from their second shape
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            torch._dynamo.maybe_mark_dynamic(ids, 1)
        with self.autocast():  # no KV cache: a training forward has no use for one (and its state adds guards)
            h_BLH = self.decoder(input_ids=ids, use_cache=False).last_hidden_state
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
                parts = [losses.token_logprobs(self.head(h[s:s + chunk]), targets[s:s + chunk])
                         for s in range(0, h.shape[0], chunk)]
        import torch

        return torch.cat(parts)

    def micro_step(self, examples: list[Example], num_tokens: int, beta: float) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate. Returns summed metric contributions."""
        import torch

        cfg, obj = self.config, self.objective
        batch = collate(examples, bucket=self.bucket)
        dev = {k: v.to(self.device) for k, v in batch.items() if k not in ("ids_BL",)}
        extra = {}
        if obj.reference(cfg):
            extra["ref_logp"] = self.reference_logprobs(batch)
        if obj.self_teacher:
            with self.base_weights():
                extra["teacher_h"] = self.hidden(collate(examples, context="teacher", bucket=self.bucket))
        if self.compiled:  # tensors, not Python numbers: a new step's values must not recompile chunk_loss
            num_tokens = torch.tensor(float(num_tokens), device=self.device)  # (copied before the decoder is queued)
            beta = torch.tensor(float(beta), device=self.device)
        h_NH = self.hidden(batch)
        h_detached = h_NH.detach().requires_grad_()
        sums: dict[str, torch.Tensor] = {}
        n = h_NH.shape[0]
        for start in range(0, n, cfg.logit_chunk):
            sl = slice(start, min(start + cfg.logit_chunk, n))
            part = {k: v[sl] for k, v in extra.items() if k != "teacher_h"}
            if "teacher_h" in extra:
                with self.base_weights(), self.autocast():
                    part["teacher_logits"] = self.head(extra["teacher_h"][sl])
            loss, metrics = self.chunk_loss(h_detached[sl], {k: v[sl] for k, v in dev.items()}, part, num_tokens, beta)
            loss.backward()
            for key, value in {"loss": loss, **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value.detach().double()
            del loss, metrics, part
        h_NH.backward(h_detached.grad)
        return {key: float(value) for key, value in sums.items()}

    def _chunk_loss(self, h_NH, tok: dict, extra: dict, num_tokens, beta):
        """LM head + loss of one chunk of positions: (loss, metrics). Compiled as one function under --compile."""
        with self.autocast():
            logits_NV = self.head(h_NH)
        if self.compiled:
            logits_NV, tok = self._compact(logits_NV, tok)
        out = self._loss(logits_NV, tok, extra, num_tokens, beta)
        return out.loss, out.metrics

    def _compact(self, logits_NV, tok: dict):
        """The compacted logits and ids (compact_logits) where the objective reads the logits at a few ids."""
        key = self.objective.compact
        if key is None:
            return logits_NV, tok
        ids = tok[key]
        ids_NK = ids if ids.dim() == 2 else ids.unsqueeze(-1)  # [N] (the sampled tokens) or [N, K]
        temperature = self.objective.temperature(self.config)
        # the sampled tokens read too (fkl's ratio and drift, at temperature 1) by a loss compacted at other ids:
        # the sampled token is one more column (its index in the compacted logits becomes targets_N)
        calls = [self.objective.call, *(call for _, call in self.objective.metrics)]
        sampled = key != "targets_N" and any("targets_N" in call.args for call in calls)
        if sampled and temperature != 1.0:
            return logits_NV, tok
        if sampled:
            ids_NK = torch.cat([ids_NK, tok["targets_N"].unsqueeze(-1)], -1)
        if ids_NK.shape[-1] >= logits_NV.shape[-1]:
            return logits_NV, tok
        compact_NB, first_NK = compact_logits(logits_NV, ids_NK, temperature)
        if sampled:
            return compact_NB, {**tok, key: first_NK[:, :-1], "targets_N": first_NK[:, -1]}
        return compact_NB, {**tok, key: first_NK if ids.dim() == 2 else torch.zeros_like(ids)}

    def _loss(self, logits_NV, tok: dict, extra: dict, num_tokens, beta) -> losses.LossOutput:
        """The objective's pure function of losses.py (and its extra metrics) on one chunk."""
        chunk = {**tok, **extra, "num_tokens": num_tokens, "beta": beta}
        out = call_loss(self.objective.call, logits_NV, chunk, self.config)
        for name, call in self.objective.metrics:
            out.metrics[name] = call_loss(call, logits_NV, chunk, self.config)
        return out


def call_loss(call, logits_NV, chunk: dict, config):
    """losses.<call.fn> on a chunk's tensors and the config's options (objectives.Call)."""
    fn = getattr(losses, call.fn)
    kwargs = {key: chunk.get(name) for key, name in call.kwargs}
    return fn(logits_NV, *[chunk[name] for name in call.args], **kwargs, **call.options(config))
