"""Model FLOPs per token, the numerator of MFU.

The PaLM convention (Chowdhery et al. 2022, appendix B): 6 x non-embedding parameters for the
matrix multiplications of forward and backward, plus 12 x layers x hidden size x sequence length
for the attention scores and the weighted sum. The output projection counts as non-embedding even
when it shares its weight with the input embedding, because its matrix multiplication happens
either way; the input embedding is a lookup and costs no FLOPs. A mixture of experts counts the
parameters a token uses: of each MoE layer's routed experts only its top-k (its active parameters).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    non_embedding_parameters: int
    layers: int
    hidden_size: int
    seq_len: int

    @property
    def flops_per_token(self) -> int:
        return 6 * self.non_embedding_parameters + 12 * self.layers * self.hidden_size * self.seq_len


def model_shape(model, seq_len: int) -> ModelShape:
    """Counts the parameters of an HF causal LM (before any parallel wrapping)."""
    total = sum(p.numel() for p in model.parameters())
    input_embedding = model.get_input_embeddings().weight
    output_embedding = model.get_output_embeddings().weight
    non_embedding = total - input_embedding.numel()
    if output_embedding is input_embedding:
        non_embedding += output_embedding.numel()
    config = model.config
    unused_experts = _unused_expert_fraction(config.to_dict())
    for name, parameter in model.named_parameters():
        # Learned absolute position embeddings (GPT-2) are lookups too; Llama has none.
        if name.endswith("wpe.weight"):
            non_embedding -= parameter.numel()
        if unused_experts and ".mlp.experts." in name:
            non_embedding -= round(parameter.numel() * unused_experts)
    return ModelShape(
        parameters=total,
        non_embedding_parameters=non_embedding,
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        seq_len=seq_len,
    )


def _unused_expert_fraction(config: dict) -> float:
    """The fraction of routed experts a token does not use (0 for a dense model)."""
    from training_jobs.contract.moe import expert_shape

    shape = expert_shape(config.get("model_type", ""), config)
    return 0.0 if shape is None else 1 - shape.top_k / shape.num_experts


def mfu(tokens_per_second: float, flops_per_token: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the measured peak."""
    return tokens_per_second * flops_per_token / peak_flops
