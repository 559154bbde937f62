"""Real models nobody here wrote: tiny random-init transformers configs (nothing is downloaded).

Per model, compiled with fxfuse on the CPU (``policy="always"``): the output (and in training, with
dropout off, every parameter's gradient) equals eager's, and the coverage report fuses exactly the
GEMM chains listed in ``FUSED`` — in training with the models' own dropout on too (its masks can't
equal eager's: tests/test_dropout.py tests what they mean) — the table states what fxfuse takes from each model today, so a
change that fuses more (or less) shows here. What still stops the others is in the README's known
limits: the attention projections with nothing after them but a split or a view into heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxfuse
from support import check_against_eager, compile_fxfuse

transformers = pytest.importorskip("transformers")

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ = 64, 2, 4, 128, 100, 16


def _no_dropout(config):
    for name in list(vars(config)):
        if ("dropout" in name or "pdrop" in name) and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)
    return config


def _config(name: str):
    T = transformers
    if name == "bert":
        return T.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            intermediate_size=FFN, vocab_size=VOCAB), T.BertModel
    if name == "gpt2":
        return T.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=32,
                            bos_token_id=0, eos_token_id=0), T.GPT2Model
    if name in ("llama", "qwen2"):
        config = T.LlamaConfig if name == "llama" else T.Qwen2Config
        model = T.LlamaModel if name == "llama" else T.Qwen2Model
        return config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, intermediate_size=FFN, vocab_size=VOCAB), model
    if name in ("t5", "t5_gated_gelu"):
        return T.T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
                          vocab_size=VOCAB, feed_forward_proj="relu" if name == "t5" else "gated-gelu"), T.T5EncoderModel
    if name == "vit":
        return T.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=FFN, image_size=32, patch_size=8), T.ViTModel
    if name == "clip":
        tower = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS)
        return T.CLIPConfig(text_config=dict(tower, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                                             eos_token_id=1, pad_token_id=1),
                            vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=32), T.CLIPModel
    raise KeyError(name)


class RealModel(nn.Module):
    """The model's last hidden state (CLIP: its image-text logits), from positional inputs (what
    the test harness calls)."""

    def __init__(self, name: str, train: bool, dropout: bool = False):
        super().__init__()
        config, model = _config(name)
        self.model = model(_no_dropout(config) if train and not dropout else config)
        self.keys = {"vit": ("pixel_values",), "clip": ("input_ids", "pixel_values")}.get(name, ("input_ids",))

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.keys, inputs)))
        return out.logits_per_image if "pixel_values" in self.keys[1:] else out[0]


def _inputs(name: str):
    image, tokens = (lambda: torch.randn(2, 3, 32, 32)), (lambda: torch.randint(0, VOCAB, (2, SEQ)))
    return {"vit": lambda: [image()], "clip": lambda: [tokens(), image()]}.get(name, lambda: [tokens()])


# GEMM chains fused in full (report rows with status "fused"), out of the report's rows. Eval runs
# with the models' dropout (inactive); training with dropout off, and with it on: the same chains
# fuse, their dropout drawn inside the fused op.
FUSED = {
    # attention output and FFN output (Linear + residual + LayerNorm; the last one's value is also
    # the pooler's first token, a row selection, which ends the chain), the intermediate's GELU;
    # the pooler's own chain is never read (only the last hidden state is): not fused
    "bert": {"eval": (6, 13), "train": (6, 13)},
    # Conv1D (addmm with a (K, N) weight, views around it): c_fc + gelu_new (written out) in each
    # block; c_proj + residual, the sum returned too (keep()) for the next block and normalised by
    # the next LayerNorm in the same op; the attention's c_attn feeds a split
    "gpt2": {"eval": (6, 8), "train": (6, 8)},
    # SwiGLU: silu(gate(x)) * up(x) is one op running both GEMMs (up is its second GEMM); o_proj
    # and down_proj + residual, the sum kept and the next hand-written RMSNorm (recognised as
    # rms_norm) and its weight fused; q_proj and k_proj with their rotary embedding (ending at the
    # view into heads); v_proj has nothing after it but attention
    "llama": {"eval": (12, 14), "train": (12, 14)},
    "qwen2": {"eval": (12, 14), "train": (12, 14)},
    # the FFN's wi + ReLU (or gated GELU: wi_0 and wi_1 one op); the attention's o and the FFN's wo
    # + residual, kept, and the next T5LayerNorm (a hand-written RMS norm); the q/k/v projections
    # split into heads
    "t5": {"eval": (6, 12), "train": (6, 12)},
    "t5_gated_gelu": {"eval": (8, 14), "train": (8, 14)},
    # the intermediate's GELU; the attention output + residual, kept and normalised by
    # layernorm_after in the same op, and the FFN output + residual + the next LayerNorm (the last
    # one's value also the pooler's first token; the pooler's own chain is never read)
    "vit": {"eval": (6, 13), "train": (6, 13)},
    # both towers' attention output and FFN blocks as BERT's (the text tower's last sum normalised
    # by final_layer_norm, then its end-of-text rows picked by index tensors; the vision tower's
    # first token picked), QuickGELU, the projections and their embeddings over their Euclidean
    # norm (F.normalize, written out), and the logits GEMM times the scale (read back transposed)
    "clip": {"eval": (15, 27), "train": (15, 27)},
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(FUSED))
def test_a_real_model_computes_what_eager_computes_and_fuses_what_the_table_says(name, train):
    torch.manual_seed(0)
    report = check_against_eager(lambda: RealModel(name, train), _inputs(name), train=train, grads=train,
                                 draws=2)
    fused = sum(r.status == "fused" for r in report.rows)
    assert (fused, len(report.rows)) == FUSED[name]["train" if train else "eval"], [
        (r.status, r.reason) for r in report.rows]


WITH_DROPOUT = ["bert", "gpt2", "t5", "t5_gated_gelu"]  # Llama, Qwen2 and ViT default to p = 0


@pytest.mark.parametrize("name", WITH_DROPOUT)
def test_a_real_model_training_with_its_dropout_fuses_as_without(name):
    """Dropout in training (the configs' own p) joins the chains: the same GEMMs fuse as with it
    off; the step runs and every parameter eager trains gets a finite gradient."""
    torch.manual_seed(0)
    model = RealModel(name, train=True, dropout=True).train()
    fxfuse.reset_report()
    out = compile_fxfuse(model)(*_inputs(name)())
    out.float().pow(2).mean().backward()
    rows = fxfuse.last_report().rows
    assert (sum(r.status == "fused" for r in rows), len(rows)) == FUSED[name]["train"]
    assert any("dropout(p=" in (r.program or "") for r in rows)
    assert torch.isfinite(out).all()
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), param_name


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_a_real_model_compiled_with_dynamic_true_serves_every_size_with_one_graph_fused_as_the_table_says(name):
    """``torch.compile(..., dynamic=True)``: batch and sequence symbolic, the models' floats graph
    inputs (GPT-2's ``math.pi``). One graph serves three shapes, equal to eager, and fuses what a
    static compile fuses; the graph fxfuse hands on holds no size it traced (FX warns of one)."""
    import warnings

    torch.manual_seed(0)
    model = RealModel(name, train=False).eval()
    fxfuse.reset_report()
    compiled = compile_fxfuse(model, dynamic=True)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for batch, seq in ((2, SEQ), (3, SEQ + 5), (5, SEQ - 3)):
            x = torch.randn(batch, 3, 32, 32) if name == "vit" else torch.randint(0, VOCAB, (batch, seq))
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    rows = fxfuse.last_report().rows
    assert (sum(r.status == "fused" for r in rows), len(rows)) == FUSED[name]["eval"]
    assert not [str(w.message) for w in caught if "fxfuse" in str(w.message) or "Raw SymInt" in str(w.message)]
