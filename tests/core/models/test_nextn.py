"""The NextN (multi-token prediction) layer of DeepSeek-V3 checkpoints: loaded when present, and run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugserve.core.forward_batch import ForwardMode
from tests.checkpoints import add_mtp_layer, random_hf_model, save_hf_model, tiny_v3_config
from tests.paged_runner import PagedRunner, Request, load_reference_model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_nextn_layer_is_loaded_and_predicts_from_hidden_state_and_next_embedding(tmp_path):
    directory = save_hf_model(random_hf_model(tiny_v3_config()), tmp_path)
    mtp = add_mtp_layer(directory, num_layers=3)
    model = load_reference_model(directory)
    assert model.nextn is not None and model.num_kv_layers == 4
    assert torch.equal(model.nextn.eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])
    assert torch.equal(model.nextn.layer.self_attn.kv_b_proj.weight, mtp["model.layers.3.self_attn.kv_b_proj.weight"])

    prompt = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = PagedRunner(model)
    request = Request()
    runner.step(ForwardMode.EXTEND, [request], [prompt[:-1]])
    batch = runner.last_batch
    with torch.no_grad():
        hidden = model(torch.tensor(prompt[:-1]), batch)  # rewrites the same KV; the main layers' output
        out = model.forward_nextn(torch.tensor(prompt[1:]), hidden, batch)
        # The MTP layer's input, computed here from the checkpoint tensors themselves.
        embeddings = F.embedding(torch.tensor(prompt[1:]), mtp["model.layers.3.embed_tokens.weight"])
        normed = torch.cat([_rms(embeddings, mtp["model.layers.3.enorm.weight"]),
                            _rms(hidden, mtp["model.layers.3.hnorm.weight"])], dim=-1)
        mixed = normed @ mtp["model.layers.3.eh_proj.weight"].T
        out_block, residual = model.nextn.layer(mixed, None, model.rotary, model.rotary.cos_sin(batch.positions),
                                                batch, model.backends.attention_prefill)
        layer_out = out_block + residual
        expected = _rms(layer_out, mtp["model.layers.3.shared_head.norm.weight"])
    assert torch.allclose(out, expected, atol=1e-5)
    assert model.compute_logits(out).shape == (8, 320)


def test_nextn_layer_is_skipped_when_the_checkpoint_has_none(tmp_path):
    directory = save_hf_model(random_hf_model(tiny_v3_config(num_nextn_predict_layers=1)), tmp_path)
    assert load_reference_model(directory).nextn is None
