"""Real models built from configurations with random weights (no downloads).

Each builder returns ``(model, make_inputs)`` where ``make_inputs(batch, seq, device)`` returns the positional
arguments of one forward call, and raises ``MissingLibrary`` (with the reason) when its library is absent.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["MissingLibrary", "BUILDERS", "build"]


class MissingLibrary(RuntimeError):
    """The model's library is not installed here; the message names it."""


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise MissingLibrary("transformers is not installed") from e
    return transformers


def _token_inputs(vocab: int) -> Callable[..., tuple]:
    def make(batch: int, seq: int, device: str) -> tuple:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)

    return make


def gpt2(attn: str = "eager", n_layer: int = 12, n_embd: int = 768, n_head: int = 12, **_: Any):
    """Hugging Face GPT-2 (small by default) with the attention implementation named ("eager" or "sdpa")."""
    tf = _transformers()
    cfg = tf.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=2048, use_cache=False)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model, _token_inputs(cfg.vocab_size)


def llama(attn: str = "eager", n_layer: int = 8, hidden: int = 1024, heads: int = 16, kv_heads: int = 4,
          intermediate: int | None = None, **_: Any):
    """A Llama-style decoder with grouped-query attention (16 query heads share 4 key/value heads by default);
    the MLP is ``intermediate`` wide (default 11/4 of ``hidden``)."""
    tf = _transformers()
    cfg = tf.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4,
        num_hidden_layers=n_layer,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, use_cache=False,
    )
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model, _token_inputs(cfg.vocab_size)


def bert(attn: str = "eager", n_layer: int = 12, **_: Any):
    """Hugging Face BERT-base encoder."""
    tf = _transformers()
    cfg = tf.BertConfig(num_hidden_layers=n_layer)
    model = tf.AutoModel.from_config(cfg, attn_implementation=attn)
    return model, _token_inputs(cfg.vocab_size)


def vit(attn: str = "sdpa", n_layer: int = 12, **_: Any):
    """Hugging Face ViT-base/16 on 224 x 224 images; its inputs are random images of the model's dtype."""
    tf = _transformers()
    cfg = tf.ViTConfig(num_hidden_layers=n_layer)
    model = tf.AutoModel.from_config(cfg, attn_implementation=attn)

    def make(batch: int, _seq: int, device: str) -> tuple:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g).to(device),)

    return model, make


def t5_encoder(attn: str = "sdpa", n_layer: int = 12, **_: Any):
    """Hugging Face T5's encoder at base size: attention with a learned relative-position bias, unscaled, added
    to the scores (an SDPA call's float mask on the "sdpa" path)."""
    tf = _transformers()
    cfg = tf.T5Config(d_model=768, d_kv=64, d_ff=3072, num_layers=n_layer, num_heads=12, use_cache=False)
    cfg._attn_implementation = attn
    return tf.T5EncoderModel(cfg), _token_inputs(cfg.vocab_size)


def resnet50(**_: Any):
    try:
        import torchvision
    except ImportError as e:
        raise MissingLibrary("torchvision is not installed") from e
    model = torchvision.models.resnet50()

    def make(batch: int, _seq: int, device: str) -> tuple:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, 3, 224, 224, generator=g).to(device).contiguous(memory_format=torch.channels_last),)

    return model.to(memory_format=torch.channels_last), make


def tiny_gpt(n_layer: int = 4, n_embd: int = 256, n_head: int = 4, block_size: int = 1024, **_: Any):
    """The project's own small GPT (kpt_compiler.models.gpt): hand-written attention, no dependencies."""
    from .gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size)
    return GPT(cfg), _token_inputs(cfg.vocab_size)


BUILDERS: dict[str, Callable] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
    "t5-encoder": t5_encoder,
    "resnet50": resnet50,
    "tiny-gpt": tiny_gpt,
}


def build(name: str, **kwargs: Any):
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name](**kwargs)
