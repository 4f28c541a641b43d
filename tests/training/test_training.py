"""The training recipe on the CPU: corpus cleaning, a few training steps end to end (export, loss curve, plugserve
and transformers loading the export), and the export's numerics against the trained modules, NextN included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from plugserve.core.forward_batch import ForwardMode
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR
from tests.core.models.test_deepseek import assert_logits_match
from tests.paged_runner import PagedRunner, Request, load_reference_model
from training import prepare_data, train
from training.export import INDEX_FILE, MAX_SHARD_BYTES, export
from training.model import TrainingModel, model_config
from training.verify import dequantized_copy

REPO_ROOT = Path(__file__).resolve().parents[2]

REST = """\
.. _tut-if:

*****************
Control Flow
*****************

Perhaps the most well-known statement type is the :keyword:`!if` statement. See
:ref:`the tutorial <tut-intro>` and ``elif``. For example::

   >>> if x < 0:
   ...     x = 0

.. index:: statement: for

The :func:`~os.path.join` function
==================================

.. function:: join(path, *paths)

   Join one or more path segments intelligently, as `described here <https://example.org>`_.

   .. versionadded:: 3.4

   .. note::
      A **drive letter** resets the path.

.. toctree::
   :maxdepth: 2

   hidden/page
"""


def test_rest_sections_keep_prose_signatures_and_code_and_drop_markup():
    first, second = prepare_data.rest_sections(REST)
    assert first.title == "Control Flow"
    assert first.text == ("Perhaps the most well-known statement type is the if statement. See\n"
                          "the tutorial and elif. For example:\n\n"
                          "   >>> if x < 0:\n   ...     x = 0")
    assert second.title == "The join function"
    assert second.text == ("join(path, *paths)\n\n"
                           "Join one or more path segments intelligently, as described here.\n\n"
                           "New in version 3.4\n\nNote:\nA drive letter resets the path.")


def _sections() -> dict[str, list[prepare_data.Section]]:
    """60 small documents (2 of them held out) cut from the first half of the held-out text the benchmarks score
    (Python's documentation, fixed: a corpus of this repository's own docs changed the trained model, and which
    near-tied tokens the parity check met, with every edit of them)."""
    text = (REPO_ROOT / "benchmarks" / "data" / "heldout_docs.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in text[: len(text) // 2].split("\n\n") if len(p) > 80]
    return {f"doc{i}": [prepare_data.Section(f"Part {i}", p) for p in paragraphs[i::60]] for i in range(60)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """prepare_data on the small corpus (tokenizer trained on it), then 3 training steps, exported and verified."""
    root = tmp_path_factory.mktemp("training")
    corpus = prepare_data.prepare(_sections(), root / "data")
    assert corpus["documents"] == {"train": 58, "heldout": 2}
    out = root / "out"
    train.main(["--data", str(root / "data"), "--out", str(out), "--device", "cpu", "--steps", "3",
                "--batch-size", "2", "--seq-len", "32", "--evals", "1", "--eval-windows", "2", "--verify"])
    return out, json.loads((out / "losses.json").read_text())


def test_training_writes_losses_a_loss_curve_and_a_checked_export(trained):
    out, history = trained
    assert [r["step"] for r in history["train"]] == [1, 3]
    assert history["steps"] == 3 and history["chosen_eval"]["step"] == 3
    assert all(r["main"] > 0 and r["mtp"] > 0 and 0 <= r["mtp_agreement"] <= 1 for r in history["train"])
    assert history["unigram_perplexity_heldout"] > 1
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Both loaders ran the export: plugserve's engine (block-FP8, NextN layer loaded) and transformers.
    report = history["verify"]
    assert len(report["samples"]) == 8 and all(s["plugserve"] and s["transformers"] and s["served"]
                                               for s in report["samples"])
    assert report["hf_parity"] == 1.0  # the same float32 math on both sides


def test_export_is_deepseek_v3_block_fp8_with_the_nextn_layer(trained):
    model_dir = trained[0] / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["topk_method"] == "noaux_tc"
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    assert config["rope_scaling"]["type"] == "yarn" and config["num_nextn_predict_layers"] == 1
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        assert shard.stat().st_size <= MAX_SHARD_BYTES + 2**20
        with safe_open(shard, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    index = json.loads((model_dir / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    mtp = f"model.layers.{config['num_hidden_layers']}"
    fp8 = [f"{mtp}.eh_proj.weight", f"{mtp}.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
           "model.layers.0.mlp.down_proj.weight", "model.layers.2.mlp.shared_experts.gate_proj.weight"]
    for name in fp8:
        assert tensors[name].dtype == torch.float8_e4m3fn and tensors[name + "_scale_inv"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape == (8, 1)  # [1024, 128] in blocks
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 f"{mtp}.enorm.weight", f"{mtp}.hnorm.weight", f"{mtp}.shared_head.norm.weight",
                 f"{mtp}.shared_head.head.weight", f"{mtp}.embed_tokens.weight"):
        assert tensors[name].dtype == torch.bfloat16 and name + "_scale_inv" not in tensors
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert (model_dir / "tokenizer_config.json").is_file() and (model_dir / "tokenizer.json").is_file()


def _load_deepseek_tensors(model: TrainingModel, model_dir: Path) -> None:
    """The inverse of the export's renaming: DeepSeek's tensors (one per expert) into the training modules."""
    tensors = {}
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    experts = range(model.config.n_routed_experts)

    def get(name: str) -> torch.Tensor:
        prefix = name.rsplit(".", 1)[0] + "."
        if name.endswith(".experts.gate_up_proj"):
            return torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                           tensors[f"{prefix}{e}.up_proj.weight"]]) for e in experts])
        if name.endswith(".experts.down_proj"):
            return torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in experts])
        return tensors[name]

    mtp = f"model.layers.{model.config.num_hidden_layers}."
    model.lm.load_state_dict({name: get(name) for name in model.lm.state_dict()})
    model.mtp.load_state_dict({name: get(mtp + name.removeprefix("layer.")) for name in model.mtp.state_dict()})


def test_plugserve_computes_what_the_training_modules_compute_nextn_included(tmp_path):
    """The export read back into the training modules and into plugserve (its weights dequantized: float32 on both
    sides) gives the same logits for the next token and, through plugserve's NextN layer, for the one after."""
    torch.manual_seed(0)
    model = TrainingModel(model_config(4096, seq_len=64)).eval()
    with torch.no_grad():
        for router in model.routers:
            router.e_score_correction_bias.normal_(0, 0.1)
    fp8_dir = tmp_path / "fp8"
    export(model, EMBEDDED_MODEL_DIR, fp8_dir)
    dequantized = dequantized_copy(fp8_dir, tmp_path / "dequantized")
    _load_deepseek_tensors(model, dequantized)

    prompt = torch.randint(0, 4096, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        logits, mtp_logits = model.logits(torch.tensor([prompt[:-1]]), torch.tensor([prompt[1:]]))
    ours = load_reference_model(dequantized)
    runner = PagedRunner(ours)
    assert_logits_match(runner.step(ForwardMode.EXTEND, [Request()], [prompt[:-1]]), logits[0])
    with torch.no_grad():
        hidden = ours(torch.tensor(prompt[:-1]), runner.last_batch)
        nextn = ours.compute_logits(ours.forward_nextn(torch.tensor(prompt[1:]), hidden, runner.last_batch))
    assert_logits_match(nextn, mtp_logits[0])
    # The block-FP8 checkpoint itself (w8a8 GEMMs) stays close to its dequantized weights.
    fp8_logits = PagedRunner(load_reference_model(fp8_dir)).step(ForwardMode.EXTEND, [Request()], [prompt[:-1]])
    assert_logits_match(fp8_logits, logits[0], min_cosine=0.98, max_abs=None)
