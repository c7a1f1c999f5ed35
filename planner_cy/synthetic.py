"""Synthetic profiles of GPT- and Llama-style models, for benchmarks and the simulator (no GPU, no torch).

The model is an embedding layer, `blocks` transformer blocks and a head (final norm + an untied LM head):
blocks + 2 planner layers. Per layer and microbatch (b samples of s tokens, hidden h, a heads of which kv share
keys and values (h_kv = h * kv / a), MLP width f, vocabulary V), mixed-precision training with Adam, no
activation recomputation. The GPT family has a 2-matrix GeLU MLP (f = 4h), biases, layer norms and learned
positions; the Llama family a 3-matrix SwiGLU MLP, no biases, RMSNorm and rotary positions:

- parameters: block 2h^2 + 2h*h_kv (Q, O; K, V) + n*h*f (n = 2 GeLU, 3 SwiGLU) + 13h (GPT: biases and norms) or
  2h (Llama: norms); embedding V*h (+ s*h learned positions); head V*h + 2h.
- state_bytes = 16 per parameter (fp16 weights and gradients, fp32 master weights and two Adam moments).
- forward FLOPs: block 2*b*s*(block matmul parameters) + 4*b*s^2*h (GPT: 24*b*s*h^2 + 4*b*s^2*h); head
  2*b*s*h*V; embedding 0. Backward = 2 x forward.
- activation_bytes: block s*b*h*(34 + 5*a*s/h) for GPT (Korthikanti et al., "Reducing Activation Recomputation
  in Large Transformer Models", 2022, section 4.1), generalised term by term: attention 7sbh + 4sb*h_kv +
  5as^2b (left out with flash_attention), MLP 3sbh + 4sbf (GeLU: its input and output) or 8sbf (SwiGLU: gate, up, activation, product),
  norms 4sbh; embedding 8*b*s (token ids); head 4*b*s*h + 4*b*s*V (norm input and output in fp16, logits in
  fp32 for the loss).
- replicated_activation_bytes (what tensor parallelism does not split; the same paper, section 4.2: sbh(10 +
  24/t + 5as/(ht)) per GPT block): block 10*s*b*h (norm inputs, the attention and MLP inputs, two dropout
  masks); embedding all (token ids); head 4*b*s*h (the vocabulary-parallel logits split).
- output_bytes = 2*b*s*h (the fp16 hidden state), 0 for the head.
- time (roofline): max(FLOPs / gpu_flops, bytes moved / hbm_bandwidth), where the forward moves the fp16
  weights once plus the activations it keeps, the backward twice that. Tensor-parallel times are not given:
  the planner estimates them (compute / t plus the Megatron all-reduces; planner_cy/templates.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from oobleck.api.profile import LayerProfile, ModelProfile

STATE_BYTES_PER_PARAM = 16
"""fp16 weights (2) + fp16 gradients (2) + fp32 master weights (4) + Adam's two moments (4 + 4)."""


@dataclass(frozen=True)
class GPTShape:
    """The architecture of a GPT- or Llama-style model."""

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
    family: str = "gpt"
    """"gpt" (GeLU MLP, biases, learned positions) or "llama" (SwiGLU MLP, no biases, rotary positions)"""
    ffn: int = 0
    """MLP width f; 0: 4h"""
    kv_heads: int = 0
    """key/value heads (grouped-query attention; a must be a multiple); 0: a"""
    flash_attention: bool = False
    """attention that keeps no s x s scores (FlashAttention): the 5as^2b activation term is left out"""


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
    # Llama 3 70B (Llama Team, "The Llama 3 Herd of Models", 2024, table 3: 80 layers, model dimension 8,192,
    # FFN dimension 28,672, 64 attention heads, 8 key/value heads, vocabulary 128,000 (128,256 in the released
    # config), pre-trained at a context of 8,192), costed with FlashAttention as it is trained.
    "llama3-70b": GPTShape(
        blocks=80,
        hidden=8192,
        heads=64,
        vocab=128256,
        seq_len=8192,
        family="llama",
        ffn=28672,
        kv_heads=8,
        flash_attention=True,  # trained with it: s x s scores of 64 heads at 8,192 tokens would be 21 GB per block
    ),
}
"""Every synthetic model by name: the GPT-3 sizes, the Oobleck paper's evaluation models and Llama 3 70B."""


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")


def _layer(
    name: str,
    flops: float,
    params: int,
    activation: int,
    output: int,
    gpu_flops: float,
    hbm: float,
    replicated: int,
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
        replicated_activation_bytes=replicated,
    )


def _check_shape(shape: GPTShape, seq_len: int, microbatch_size: int) -> None:
    named = (
        ("blocks", shape.blocks),
        ("hidden", shape.hidden),
        ("heads", shape.heads),
        ("vocab", shape.vocab),
        ("seq_len", seq_len),
        ("microbatch_size", microbatch_size),
    )
    for field, value in named:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}: must be a positive integer, got {value!r}")
    if shape.hidden % shape.heads:
        raise ValueError(f"hidden: must be a multiple of heads, got hidden = {shape.hidden}, heads = {shape.heads}")
    if shape.family not in ("gpt", "llama"):
        raise ValueError(f"family: must be 'gpt' or 'llama', got {shape.family!r}")
    if not isinstance(shape.ffn, int) or shape.ffn < 0:
        raise ValueError(f"ffn: must be an integer >= 0 (0: 4 * hidden), got {shape.ffn!r}")
    if not isinstance(shape.kv_heads, int) or shape.kv_heads < 0 or (shape.kv_heads and shape.heads % shape.kv_heads):
        raise ValueError(f"kv_heads: must divide heads = {shape.heads} (0: heads), got {shape.kv_heads!r}")


def _block(shape: GPTShape, s: int, b: int) -> tuple[int, int, int]:
    """(matmul parameters, other parameters, kept activation bytes) of one block (module docstring)."""
    h, a = shape.hidden, shape.heads
    f = shape.ffn or 4 * h
    h_kv = h * (shape.kv_heads or a) // a
    gated = shape.family == "llama"
    matmul = 2 * h * h + 2 * h * h_kv + (3 if gated else 2) * h * f
    other = 2 * h if gated else 13 * h
    attention = 7 * s * b * h + 4 * s * b * h_kv + (0 if shape.flash_attention else 5 * a * s * s * b)
    mlp = 3 * s * b * h + (8 if gated else 4) * s * b * f
    return matmul, other, attention + mlp + 4 * s * b * h


def gpt_profile(
    shape: GPTShape,
    *,
    seq_len: int,
    microbatch_size: int,
    gpu_flops: float,
    hbm_bandwidth: float,
    name: str = "",
) -> ModelProfile:
    """Per-layer times and bytes of a GPT- or Llama-style model on one GPU (formulas in the module docstring).

    gpu_flops is the sustained FLOP/s of the GPU's matmuls (not the datasheet peak); hbm_bandwidth its
    memory bandwidth in bytes/s. Raises ValueError naming the first invalid argument.
    """
    h, V, s, b = shape.hidden, shape.vocab, seq_len, microbatch_size
    _check_shape(shape, s, b)
    _positive(gpu_flops=gpu_flops, hbm_bandwidth=hbm_bandwidth)
    hidden_state = 2 * b * s * h
    matmul, other, kept = _block(shape, s, b)
    block = _layer(
        "block",
        flops=2 * b * s * matmul + 4 * b * s * s * h,
        params=matmul + other,
        activation=kept,
        output=hidden_state,
        gpu_flops=gpu_flops,
        hbm=hbm_bandwidth,
        replicated=10 * s * b * h,
    )
    positions = 0 if shape.family == "llama" else s * h
    embedding = _layer("embedding", 0, V * h + positions, 8 * b * s, hidden_state, gpu_flops, hbm_bandwidth, 8 * b * s)
    head = _layer(
        "head",
        2 * b * s * h * V,
        V * h + 2 * h,
        4 * b * s * h + 4 * b * s * V,
        0,
        gpu_flops,
        hbm_bandwidth,
        4 * b * s * h,
    )
    layers = [embedding] + [block.model_copy(update={"name": f"block{k}"}) for k in range(shape.blocks)] + [head]
    return ModelProfile(
        model=name or f"gpt-{shape.blocks}x{h}",
        microbatch_size=b,
        device=f"synthetic: {gpu_flops:.3g} FLOP/s, {hbm_bandwidth:.3g} B/s HBM",
        layers=layers,
    )
