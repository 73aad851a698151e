"""Packed documents and sliding windows: each document computed as if it stood alone.

The reference is transformers itself: the same model run on every document separately
(eager attention, fp32, CPU), with its own sliding-window mask. flowtrain runs all documents
packed into rows at once, with restarting positions, and must give each document's hidden
states, loss and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import assert_grads_match, flats_from_hf, hf_model, rel_err, small_cfg

from flowtrain.model import bind, decoder_layer, embed, head_loss_and_grads, model_flat_maps, rope_tables
from flowtrain.model.attention import Documents, attend, rotary_for

TOL = 1e-5

# Rows of seq 16: documents of these lengths, packed end to end (the last one may be padding).
ROWS = [[5, 7, 4], [16], [3, 3, 3, 3, 4]]
SEQ = 16


def _positions(rows=ROWS):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _windowed(scores_len, window):
    i = torch.arange(scores_len)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return allowed


@pytest.mark.parametrize("window", [None, 1, 3, 6, 100])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attend_is_each_document_alone(window, kv_heads):
    gen = torch.Generator().manual_seed(1)
    batch, heads, hd = len(ROWS), 4, 8
    q = torch.randn(batch, heads, SEQ, hd, generator=gen)
    k = torch.randn(batch, kv_heads, SEQ, hd, generator=gen)
    v = torch.randn(batch, kv_heads, SEQ, hd, generator=gen)
    out = attend(q, k, v, Documents.from_positions(_positions()), window)
    rep = heads // kv_heads
    for r, row in enumerate(ROWS):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            qd, kd, vd = q[r, :, sl], k[r, :, sl].repeat_interleave(rep, 0), v[r, :, sl].repeat_interleave(rep, 0)
            scores = (qd @ kd.transpose(-1, -2)) / hd**0.5
            scores = scores.masked_fill(~_windowed(n, window), float("-inf"))
            ref = scores.softmax(-1) @ vd
            assert rel_err(out[r, :, sl], ref) < TOL, (r, start, n)
            start += n


def test_documents_from_positions():
    docs = Documents.from_positions(_positions())
    assert docs.cu_seqlens.tolist() == [0, 5, 12, 16, 32, 35, 38, 41, 44] + [48] * 7  # padded to 16
    assert docs.count == 9
    assert docs.max_len == SEQ and docs.packed
    assert docs.doc_ids()[0].tolist() == [0] * 5 + [1] * 7 + [2] * 4
    # A row that does not start at position 0 still starts a document.
    odd = Documents.from_positions(torch.arange(2, 10).expand(2, 8))
    assert odd.cu_seqlens.tolist()[:3] == [0, 8, 16] and odd.count == 2 and not odd.packed


def test_unpacked_rows_use_the_plain_causal_kernel():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=gen) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(attend(q, k, v, None, None), plain)
    assert torch.equal(attend(q, k, v, None, 10), plain)  # a window as long as the row
    assert not torch.equal(attend(q, k, v, None, 4), plain)
    # One document per row, given as documents, is still plain causal attention.
    single = Documents.from_positions(torch.arange(10).expand(2, 10))
    assert not single.packed
    assert rel_err(attend(q, k, v, single, None), plain) < TOL


CONFIGS = {
    "llama": small_cfg(),
    "mistral-window-4": small_cfg(architecture="MistralForCausalLM", sliding_window=4),
    "qwen3-window-on-layer-1": small_cfg(architecture="Qwen3ForCausalLM", head_dim=16,
                                         rms_norm_eps=1e-6, sliding_window=3, max_window_layers=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_rows_equal_transformers_per_document(name):
    """Loss and every gradient of a packed batch equal the sum over documents run alone
    through transformers (with its sliding window, where the family has one)."""
    cfg = CONFIGS[name]
    model = hf_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (len(ROWS), SEQ), generator=gen)
    positions = _positions()
    # Targets: the next token inside a document; a document's last token predicts nothing.
    targets = torch.full_like(ids, -100)
    ref = torch.zeros(())
    n_targets = sum(n - 1 for row in ROWS for n in row)
    for r, row in enumerate(ROWS):
        start = 0
        for n in row:
            doc = ids[r, start:start + n]
            targets[r, start:start + n - 1] = doc[1:]
            logits = model(doc[None]).logits[0, :-1]
            ref = ref + F.cross_entropy(logits, doc[1:], reduction="sum")
            start += n
    (ref / n_targets).backward()

    layouts, flats = model_flat_maps(cfg), [f.requires_grad_() for f in flats_from_hf(model, cfg)]
    w = [bind(f, lay) for f, lay in zip(flats, layouts)]
    docs = Documents.from_positions(positions)
    cos, sin = rotary_for(*rope_tables(cfg, SEQ), docs)
    x = embed(ids, w[0]["embed_tokens"])
    for i, wl in enumerate(w[1:-1]):
        x = decoder_layer(x, wl, cos, sin, cfg, docs, cfg.layer_window(i))
    loss, dx, dnorm, dhead = head_loss_and_grads(
        x, w[-1]["norm"], w[-1]["lm_head"], targets, cfg.rms_norm_eps, 1 / n_targets)
    torch.autograd.backward([x, w[-1]["norm"], w[-1]["lm_head"]], [dx, dnorm, dhead])
    assert rel_err(loss, ref.detach()) < TOL
    assert_grads_match(model, layouts, flats, TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length kernel runs on a GPU")
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-3)])
def test_gpu_kernel_equals_the_masked_reference(window, dtype, tol):
    """On a GPU, packed rows in bf16 take the variable-length flash kernel, and in fp32 (which
    flash does not run) the masked SDPA; forward and backward agree with the masked reference on
    the CPU (bf16's rounding apart, TF32's in fp32)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(ROWS), 8, SEQ, 64, generator=gen)
    k, v = (torch.randn(len(ROWS), 2, SEQ, 64, generator=gen) for _ in range(2))
    docs = Documents.from_positions(_positions())
    dy = torch.randn_like(q)

    def run(device, dtype):
        t = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        out = attend(*t, docs.to(device), window)
        out.backward(dy.to(device, dtype))
        return [x.float().cpu() for x in (out, *(x.grad for x in t))]

    for ours, ref in zip(run("cuda", dtype), run("cpu", torch.float32)):
        assert rel_err(ours, ref) < tol


# Dynamo reads .grad of the weight views while tracing (as in StepProgram, harmless).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_layer_is_not_recompiled_per_document_count():
    """The number of documents changes every micro-batch; a compiled layer must neither be
    specialised on it (recompiled each time) nor compute anything else than the eager one."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = small_cfg(architecture="MistralForCausalLM", sliding_window=5)
    lay = model_flat_maps(cfg)[1]
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(6)) * 0.05
    torch._dynamo.reset()
    fn = torch.compile(decoder_layer, backend="aot_eager", dynamic=False)
    cos, sin = rope_tables(cfg, SEQ)
    graphs = []
    for rows in ([[5, 7, 4], [16]], [[3, 13], [8, 8]], [[2, 2, 2, 10], [1, 15]]):
        docs = Documents.from_positions(_positions(rows))
        c, s = rotary_for(cos, sin, docs)
        x = torch.randn(2, SEQ, cfg.hidden_size, requires_grad=True)
        y = fn(x, bind(flat, lay), c, s, cfg, docs, 5)
        assert rel_err(y, decoder_layer(x, bind(flat, lay), c, s, cfg, docs, 5)) < TOL
        y.sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 2


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_attention_backend_is_traced_into_the_compiled_layer():
    """The kernel order is part of a compiled layer's graph (so torch's compile cache can
    never serve a layer traced under one ``--attention-backend`` to a run under the other),
    costs no graph break, and changes no value; outside the run nothing is left set."""
    from torch._dynamo.utils import counters

    from flowtrain.model.attention import attention_backends

    cfg = small_cfg()
    lay = model_flat_maps(cfg)[1]
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(9)) * 0.05
    cos, sin = rope_tables(cfg, SEQ)
    x = torch.randn(2, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(10))
    before = torch._C._get_sdp_priority_order()
    codes = {}
    for name in ("auto", "flash"):
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm.code)
            return gm

        torch._dynamo.reset()
        counters.clear()
        with attention_backends(name, "cuda"):  # the CPU runs the same code under the order
            y = torch.compile(decoder_layer, backend=keep, dynamic=False)(x, bind(flat, lay), cos, sin, cfg, None, None)
        assert rel_err(y, decoder_layer(x, bind(flat, lay), cos, sin, cfg, None, None)) < TOL
        assert len(graphs) == 1 and not counters["graph_break"]
        codes[name] = graphs[0]
        assert "_sdpa_kernel" in graphs[0]
    assert codes["auto"] != codes["flash"]
    assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ValueError, match="auto, flash"):
        with attention_backends("cudnn-only", "cuda"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels run on a GPU")
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_gpu_causal_attention_equals_the_cpu_under_either_backend(backend):
    """Unpacked causal GQA attention in the layout the layer hands it (q from a transposed
    projection), forward and backward, under each ``--attention-backend``: the CPU's values
    (bf16 rounding apart)."""
    from flowtrain.model.attention import attention_backends

    gen = torch.Generator().manual_seed(8)
    b, heads, kv, seq, hd = 2, 8, 2, 512, 128
    q = torch.randn(b, seq, heads, hd, generator=gen).transpose(1, 2)
    k, v = (torch.randn(b, seq, kv, hd, generator=gen).transpose(1, 2) for _ in range(2))
    dy = torch.randn(b, heads, seq, hd, generator=gen)

    def run(device, dtype):
        t = [x.to(device, dtype).detach().requires_grad_() for x in (q, k, v)]
        with attention_backends(backend, device):
            out = attend(*t, None, None)
            out.backward(dy.to(device, dtype))
        return [x.float().cpu() for x in (out, *(x.grad for x in t))]

    for ours, ref in zip(run("cuda", torch.bfloat16), run("cpu", torch.float32)):
        assert rel_err(ours, ref) < 2e-2
