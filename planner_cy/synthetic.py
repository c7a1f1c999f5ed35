"""Synthetic profiles of GPT-style models, for benchmarks and the simulator (no GPU, no torch).

The model is an embedding layer, `blocks` transformer blocks and a head (final layer norm + an untied
LM head): blocks + 2 planner layers. Per layer and microbatch (b samples of s tokens, hidden h, a heads,
vocabulary V), mixed-precision training with Adam, no activation recomputation:

- parameters: block 12h^2 + 13h; embedding V*h + s*h (tokens + positions); head V*h + 2h.
- state_bytes = 16 per parameter (fp16 weights and gradients, fp32 master weights and two Adam moments).
- forward FLOPs: block 24*b*s*h^2 + 4*b*s^2*h (matmuls + attention scores); head 2*b*s*h*V; embedding 0.
  Backward = 2 x forward.
- activation_bytes: block s*b*h*(34 + 5*a*s/h) (Korthikanti et al., "Reducing Activation Recomputation
  in Large Transformer Models", 2022); embedding 8*b*s (token ids); head 4*b*s*h + 4*b*s*V (layer-norm
  input and output in fp16, logits in fp32 for the loss).
- output_bytes = 2*b*s*h (the fp16 hidden state), 0 for the head.
- time (roofline): max(FLOPs / gpu_flops, bytes moved / hbm_bandwidth), where the forward moves the fp16
  weights once plus the activations it keeps, the backward twice that.
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.api.profile import LayerProfile, ModelProfile

STATE_BYTES_PER_PARAM = 16
"""fp16 weights (2) + fp16 gradients (2) + fp32 master weights (4) + Adam's two moments (4 + 4)."""


@dataclass(frozen=True)
class GPTShape:
    """The architecture of a GPT-style model."""

    blocks: int
    """transformer blocks (the profile has blocks + 2 layers: embedding and head around them)"""
    hidden: int
    """hidden size h"""
    heads: int
    """attention heads a (h must be a multiple of a)"""
    vocab: int = 50257
    """vocabulary size V (GPT-2's BPE by default)"""
    seq_len: int = 2048
    """the context it is trained at (the default sequence length of its profile)"""


GPT3 = {
    # Brown et al., "Language Models are Few-Shot Learners", 2020, table 2.1.
    "gpt3-350m": GPTShape(blocks=24, hidden=1024, heads=16),
    "gpt3-1.3b": GPTShape(blocks=24, hidden=2048, heads=16),
    "gpt3-2.7b": GPTShape(blocks=32, hidden=2560, heads=32),
    "gpt3-6.7b": GPTShape(blocks=32, hidden=4096, heads=32),
    "gpt3-13b": GPTShape(blocks=40, hidden=5120, heads=40),
    "gpt3-175b": GPTShape(blocks=96, hidden=12288, heads=96),
}

PRESETS = {
    **GPT3,
    # The models of the Oobleck paper's evaluation (SOSP'23, and its artifact's simulator, tools/simulator/):
    # BERT-large (Devlin et al., 2019: 24 blocks, hidden 1024, 16 heads, WordPiece vocabulary 30,522, sequences
    # of 512); its encoder blocks cost what a GPT block of the same sizes costs in this arithmetic, and its
    # masked-LM head is the same vocabulary projection.
    "bert-large": GPTShape(blocks=24, hidden=1024, heads=16, vocab=30522, seq_len=512),
    # The artifact's GPT-2 configuration (tests/conftest.py of branch sosp23-artifact: Hugging Face "gpt2" with
    # num_hidden_layers 32, n_embd 1024, n_head 16, n_positions 1024).
    "gpt2-artifact": GPTShape(blocks=32, hidden=1024, heads=16, seq_len=1024),
    # GPT-3 Medium is Brown et al.'s name for the 350M model.
    "gpt3-medium": GPT3["gpt3-350m"],
}
"""Every synthetic model by name: the GPT-3 sizes and the Oobleck paper's evaluation models."""


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")


def _layer(
    name: str, flops: float, params: int, activation: int, output: int, gpu_flops: float, hbm: float
) -> LayerProfile:
    weights = 2 * params  # fp16 copy read by the forward
    forward_s = max(flops / gpu_flops, (weights + activation) / hbm)
    backward_s = max(2 * flops / gpu_flops, 2 * (weights + activation) / hbm)
    return LayerProfile(
        name=name,
        forward_ms=forward_s * 1e3,
        backward_ms=backward_s * 1e3,
        state_bytes=STATE_BYTES_PER_PARAM * params,
        activation_bytes=activation,
        output_bytes=output,
    )


def gpt_profile(
    shape: GPTShape,
    *,
    seq_len: int,
    microbatch_size: int,
    gpu_flops: float,
    hbm_bandwidth: float,
    name: str = "",
) -> ModelProfile:
    """Per-layer times and bytes of a GPT-style model on one GPU (formulas in the module docstring).

    gpu_flops is the sustained FLOP/s of the GPU's matmuls (not the datasheet peak); hbm_bandwidth its
    memory bandwidth in bytes/s. Raises ValueError naming the first invalid argument.
    """
    h, a, V, s, b = shape.hidden, shape.heads, shape.vocab, seq_len, microbatch_size
    named = (
        ("blocks", shape.blocks),
        ("hidden", h),
        ("heads", a),
        ("vocab", V),
        ("seq_len", s),
        ("microbatch_size", b),
    )
    for field, value in named:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}: must be a positive integer, got {value!r}")
    if h % a:
        raise ValueError(f"hidden: must be a multiple of heads, got hidden = {h}, heads = {a}")
    _positive(gpu_flops=gpu_flops, hbm_bandwidth=hbm_bandwidth)
    hidden_state = 2 * b * s * h
    block = _layer(
        "block",
        flops=24 * b * s * h * h + 4 * b * s * s * h,
        params=12 * h * h + 13 * h,
        activation=s * b * h * 34 + 5 * a * s * s * b,
        output=hidden_state,
        gpu_flops=gpu_flops,
        hbm=hbm_bandwidth,
    )
    embedding = _layer("embedding", 0, V * h + s * h, 8 * b * s, hidden_state, gpu_flops, hbm_bandwidth)
    head = _layer("head", 2 * b * s * h * V, V * h + 2 * h, 4 * b * s * h + 4 * b * s * V, 0, gpu_flops, hbm_bandwidth)
    layers = [embedding] + [block.model_copy(update={"name": f"block{k}"}) for k in range(shape.blocks)] + [head]
    return ModelProfile(
        model=name or f"gpt-{shape.blocks}x{h}",
        microbatch_size=b,
        device=f"synthetic: {gpu_flops:.3g} FLOP/s, {hbm_bandwidth:.3g} B/s HBM",
        layers=layers,
    )
